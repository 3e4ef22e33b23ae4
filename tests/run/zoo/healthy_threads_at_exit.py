"""Threads the script leaves running when it returns, as CPython ends them: a non-daemon writer
thread that still flushes its last records after the script's last line (joined before exit, so
its lines are printed), and a ThreadPoolExecutor never shut down (threading's own exit callback
stops its workers). Every rank exits 0 and prints its writer's last line."""

import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def writer(records: queue.Queue, rank: int) -> None:
    written = 0
    while (record := records.get()) is not None:
        written += record
    threading.Event().wait(1.0)  # a slow final flush, after the script's last line
    print(f"rank {rank}: writer flushed {written} records", flush=True)


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    records: queue.Queue = queue.Queue()
    threading.Thread(target=writer, args=(records, rank), name="writer").start()
    pool = ThreadPoolExecutor(max_workers=2)

    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)
    for _ in range(3):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        pool.submit(records.put, 1).result()
    records.put(None)
    dist.destroy_process_group()
    print(f"rank {rank}: training done")


if __name__ == "__main__":
    main()
