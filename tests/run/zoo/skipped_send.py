"""A two-stage pipeline: each step rank 0 computes the first stage and sends its activations to
rank 1, which receives them. At step 3 rank 0's batch is empty and it skips the send, so
rank 1 waits in `recv` while rank 0 goes on to the step's metric all-reduce. Each waits
for the other; plain torchrun hangs."""

import argparse
import os

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    stage = torch.nn.Linear(16, 16)
    gen = torch.Generator().manual_seed(1000 + rank)
    for step in range(1, args.steps + 1):  # steps counted from 1
        if rank == 0:
            x = torch.randn(4 if step != 3 else 0, 16, generator=gen)
            if len(x) > 0:  # an empty batch is not sent, and rank 1 is never told
                dist.send(stage(x).detach(), dst=1)  # zoo: send
        else:
            activations = torch.empty(4, 16)
            dist.recv(activations, src=0)  # zoo: recv
        metric = torch.tensor([float(step)])
        dist.all_reduce(metric)  # zoo: metric
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
