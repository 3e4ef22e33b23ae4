# nproc: 3
"""Rank 1 deadlocks with its own thread pool: fut.result() under a held lock.

Mechanism (c), BROKEN (hangs forever), 3 processes. On rank 1 (the "metrics
rank") the main thread takes `stats_lock`, submits `summarize` to a
ThreadPoolExecutor and waits for `fut.result()` while still holding the lock;
`summarize` needs the same lock. Both of rank 1's threads are blocked (no CPU).
Ranks 0 and 2 wait in the all_reduce of the loss statistics.

Drawn from: https://github.com/beehive-lab/TornadoVM/issues/490 (executor
thread waits in future.get for work that is blocked by a lock its caller
holds) and https://github.com/pytorch/pytorch/issues/87995 (one rank's
MainThread idle in a threading wait while all other ranks wait in
all_reduce).
"""
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

stats_lock = threading.Lock()
history = []


def summarize():
    with stats_lock:
        t = torch.tensor(history[-4:])
        return torch.stack([t.mean(), t.std()])


def report(pool, rank):
    if rank != 1:
        return torch.zeros(2)
    with stats_lock:
        fut = pool.submit(summarize)
        return fut.result()  # zoo: idle-future


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="metrics")
    w = torch.zeros(4, requires_grad=True)
    for step in range(12):
        x = torch.randn(10, 4)
        loss = (x @ w - x[:, 0]).pow(2).mean()
        loss.backward()
        with torch.no_grad():
            dist.all_reduce(w.grad)
            w -= 0.05 * w.grad / dist.get_world_size()
            w.grad.zero_()
        history.append(loss.item())
        if step % 4 == 3:
            stats = report(pool, rank)
            dist.all_reduce(stats)  # zoo: peer-wait
            if rank == 0:
                print(f"step {step}: mean/std of recent losses {stats.tolist()}", flush=True)
    pool.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
