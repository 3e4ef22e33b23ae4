"""Rank 0 alone registers an exit handler that all-reduces its sample counters "one last time";
rank 1 never does. Both finish the script and exit 0, leaving the process group open. At rank 0's
interpreter exit the handler's all_reduce has no partner: once rank 1's process is gone, Gloo
reports the closed connection, Python prints "Exception ignored in atexit callback" and rank 0
still exits 0. The job succeeds, and the counters were never summed."""

import atexit
import os

import torch
import torch.distributed as dist


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    counters = torch.zeros(2, dtype=torch.int64)

    def flush_counters() -> None:
        dist.all_reduce(counters)  # zoo: exit_all_reduce
        print(f"rank {rank}: samples {int(counters[0])}, skipped {int(counters[1])}", flush=True)

    if rank == 0:  # the logging rank
        atexit.register(flush_counters)

    torch.manual_seed(0)
    weight = torch.zeros(4, 1, requires_grad=True)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(1, 6):
        x = torch.randn(8, 4, generator=gen)
        keep = x.abs().max(1).values < 2.5
        counters += torch.tensor([int(keep.sum()), int((~keep).sum())])
        loss = (x[keep] @ weight - 1.0).pow(2).mean()
        loss.backward()
        with torch.no_grad():
            dist.all_reduce(weight.grad)  # zoo: all_reduce
            weight -= 0.1 * weight.grad / 2
            weight.grad.zero_()
    dist.barrier()  # zoo: final_barrier
    print(f"rank {rank}: training done", flush=True)


if __name__ == "__main__":
    main()
