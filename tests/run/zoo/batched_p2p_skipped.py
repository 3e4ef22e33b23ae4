"""A ring exchange: each step every rank passes its boundary rows to the next rank and takes the
previous rank's, in one `dist.batch_isend_irecv([P2POp(dist.isend, ...), P2POp(dist.irecv, ...)])`.
At step 3 rank 0's batch is empty and it skips the exchange, going on to the step's metric
all-reduce, while rank 1 waits on its requests for rank 0's rows. Each waits for the other;
plain torchrun hangs."""

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
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    gen = torch.Generator().manual_seed(1000 + rank)
    for step in range(1, args.steps + 1):  # steps counted from 1
        rows = 4 if (rank, step) != (0, 3) else 0
        x = torch.randn(rows, 16, generator=gen)
        if len(x) > 0:  # an empty batch has no boundary to exchange, and the neighbours are never told
            halo = torch.empty(2, 16)
            ops = [
                dist.P2POp(dist.isend, x[-2:].contiguous(), (rank + 1) % world),
                dist.P2POp(dist.irecv, halo, (rank - 1) % world),
            ]
            for work in dist.batch_isend_irecv(ops):  # zoo: batch_isend_irecv
                work.wait()  # zoo: wait
        metric = torch.tensor([float(len(x))])
        dist.all_reduce(metric)  # zoo: metric
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
