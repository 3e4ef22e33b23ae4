"""A plain DDP job for `gradsync status` and `gradsync stacks` to look at while it runs: one rank
may be slow every step (--slow-rank, --delay), and one may stop before its stall timeout
(--hang-at STEP), touching --mark when it starts to and going on once --release exists (or after
--hang-s seconds): the test holds it there for as long as its reads take, however slow the machine."""

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--step-s", type=float, default=0.05, help="every rank's own time per step")
    parser.add_argument("--hang-at", type=int, default=-1)
    parser.add_argument("--hang-s", type=float, default=0.0)
    parser.add_argument("--mark", default=None)
    parser.add_argument("--release", default=None)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, args.steps + 1):
        time.sleep(args.step_s + (args.delay if rank == args.slow_rank else 0.0))  # status: step
        if step == args.hang_at and rank == args.slow_rank:
            Path(args.mark).touch()
            held_until = time.monotonic() + args.hang_s
            while time.monotonic() < held_until and not Path(args.release).exists():
                time.sleep(0.5)  # status: hang
        model(torch.randn(4, 8)).sum().backward()  # status: backward
        optimizer.step()
    dist.barrier()  # the last all-reduce released before the interpreter goes (shared/README: Gloo teardown)


if __name__ == "__main__":
    main()
