"""Ranks blocked in different process groups: after training rank 0 averages a statistic over a
subgroup of ranks 0 and 1 (`new_group`), a step that rank 1 does not take, and rank 1 goes on to
`dist.monitored_barrier` on the default group. The subgroup's all_reduce waits for rank 1, the
barrier for rank 0; nothing on either group mismatches. Plain torchrun hangs (until the
monitored barrier's own timeout of 30 minutes)."""

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    pair = dist.new_group([0, 1])
    for step in range(1, args.steps + 1):  # steps counted from 1
        loss = torch.tensor([float(step + rank)])
        dist.all_reduce(loss)  # zoo: all_reduce
    if rank == 0:
        dist.all_reduce(torch.ones(2), group=pair)  # zoo: subgroup
    dist.monitored_barrier(timeout=timedelta(minutes=30))  # zoo: monitored_barrier
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
