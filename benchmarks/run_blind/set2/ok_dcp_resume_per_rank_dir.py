"""Checkpoint-and-resume training on 2 ranks with torch.distributed.checkpoint: a
DDP-wrapped MLP trains for a first phase on synthetic data, the model and optimizer
state are saved with DCP into the run's checkpoint folder, a fresh model and optimizer
are created and restored from that checkpoint, and training continues for a second phase."""
import datetime
import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

RUN_DIR = os.path.join(tempfile.gettempdir(), f"dcp_run_{os.environ.get('TORCHELASTIC_RUN_ID', 'x')}")


def build():
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt


def run_phase(model, opt, g, steps):
    for _ in range(steps):
        x = torch.randn(32, 12, generator=g)
        loss = nn.functional.mse_loss(model(x), x[:, :3].prod(dim=1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


def ckpt_dir(rank):
    return os.path.join(RUN_DIR, "step_10")


def train(rank):
    g = torch.Generator().manual_seed(rank)
    model, opt = build()
    loss = run_phase(model, opt, g, 10)
    dcp.save({"model": model.module.state_dict(), "optim": opt.state_dict()}, checkpoint_id=ckpt_dir(rank))
    del model, opt
    model, opt = build()
    run_phase(model, opt, torch.Generator().manual_seed(99), 1)
    state = {"model": model.module.state_dict(), "optim": opt.state_dict()}
    dcp.load(state, checkpoint_id=ckpt_dir(rank))
    model.module.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    loss2 = run_phase(model, opt, g, 10)
    if rank == 0:
        print(f"phase1 loss {loss:.4f} phase2 loss {loss2:.4f}", flush=True)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    train(dist.get_rank())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
