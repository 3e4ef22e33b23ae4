"""Training with periodic asynchronous checkpoints on 2 ranks: a DDP-wrapped MLP trains
on synthetic data and every few steps the model and optimizer state are handed to
torch.distributed.checkpoint.async_save so that writing happens in the background
while training continues; each new save first waits for the previous one to finish."""
import datetime
import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

RUN_DIR = os.path.join(tempfile.gettempdir(), f"dcp_async_{os.environ.get('TORCHELASTIC_RUN_ID', 'x')}")


def train(rank):
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    ckpt_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    pending = None
    for step in range(60):
        x = torch.randn(32, 64, generator=g)
        loss = nn.functional.mse_loss(model(x), x[:, :8].mean(dim=1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 9:
            if pending is not None:
                pending.result()
            state = {"model": model.module.state_dict(), "optim": opt.state_dict()}
            pending = dcp.async_save(state, checkpoint_id=os.path.join(RUN_DIR, f"step_{step}"),
                                     process_group=ckpt_group)
    if pending is not None:
        pending.result()
    if rank == 0:
        print(f"final loss {loss.item():.4f}", flush=True)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    train(dist.get_rank())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
