"""Rank 0 saves a checkpoint at step 5 and calls dist.barrier() inside `if rank == 0:`; rank 1 never
calls it and keeps training, so rank 0's barrier meets rank 1's gradient all-reduce: plain torchrun
hangs or fails with a Gloo error."""

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--save-at", type=int, default=5)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)
    # One fixed file, overwritten by every run: this script hangs, so it never gets to clean up.
    ckpt_path = os.path.join(tempfile.gettempdir(), "zoo_barrier_inside_rank0.pt")

    for step in range(1, args.steps + 1):  # steps counted from 1
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()  # zoo: backward
        opt.step()
        if step == args.save_at:
            if rank == 0:
                torch.save(model.state_dict(), ckpt_path)  # zoo: save
                dist.barrier()  # zoo: barrier

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
