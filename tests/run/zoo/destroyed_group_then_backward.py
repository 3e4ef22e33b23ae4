"""A helper that tidies up too early: at step 3, between the forward and the backward pass,
end_of_epoch() destroys the default process group. The backward pass still reduces the gradients
over the group DDP holds; the step's metric all_reduce then fails with the script's own ValueError
("Default process group has not been initialized"), on every rank.

Under `gradsync run` the script must fail at the same line with the same exception: the recorder
can no longer ask the destroyed group for its ranks when it records the backward pass, and that
is its own failure, not the script's (gradsync.run.harmless)."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def end_of_epoch(step: int, last_step_of_epoch: int) -> None:
    """The user's clean-up helper, called one step too early."""
    if step == last_step_of_epoch:
        dist.destroy_process_group()  # zoo: destroy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)

    for step in range(1, args.steps + 1):  # steps counted from 1
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)
        loss = F.mse_loss(ddp(x), y)
        end_of_epoch(step, last_step_of_epoch=3)  # zoo: end_of_epoch
        opt.zero_grad()
        loss.backward()  # zoo: backward
        opt.step()
        metric = loss.detach().clone()
        dist.all_reduce(metric)  # zoo: metric_all_reduce
        if rank == 0:
            print(f"step {step}: mean loss {metric.item() / world:.4f}", flush=True)


if __name__ == "__main__":
    main()
