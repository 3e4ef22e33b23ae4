"""Rank 1 has 3 fewer batches and reaches the final barrier alone; prints when the hang starts.

Used to measure the time from the start of a stall to gradsync's printed diagnosis.
"""

import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = 8 if rank == 0 else 5
    for _ in range(batches):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()  # zoo: backward
        optimizer.step()
    # Both ranks are blocked for good once both have passed this point.
    print(f"rank {rank}: HANG STARTS AT {time.time():.3f}", flush=True)
    dist.barrier()  # zoo: barrier
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
