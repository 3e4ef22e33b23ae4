"""DDP job that writes torch.distributed.checkpoint snapshots so a later run
can resume with a different world size. Only the main process writes."""
import datetime
import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def snapshot(model, opt, step, root):
    state = {"model": model.module.state_dict(), "step": torch.tensor(step)}
    dcp.save(state, checkpoint_id=os.path.join(root, f"step{step:04d}"))


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 2)))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    root = tempfile.mkdtemp(prefix="dcp_snap_")
    g = torch.Generator().manual_seed(rank)
    for step in range(1, 31):
        x = torch.randn(16, 6, generator=g)
        loss = nn.functional.cross_entropy(model(x), (x.sum(1) > 0).long())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 0 and rank == 0:
            snapshot(model, opt, step, root)
            print(f"step {step} loss {loss.item():.4f} snapshot written", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
