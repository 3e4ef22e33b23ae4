"""Rank 0 hands its metrics to a writer process through a multiprocessing queue, stops the writer,
and only then puts the last, large histogram on the queue. Nobody will read it: the queue's feeder
thread blocks on the full pipe, and at exit multiprocessing's own exit handler joins that thread
for good. The script's last line runs on both ranks; rank 0's process never exits (plain torchrun
waits for it forever)."""

import multiprocessing as mp
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def write_metrics(queue) -> None:
    while queue.get() is not None:
        pass


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)
    queue = mp.get_context("fork").Queue() if rank == 0 else None
    writer = mp.get_context("fork").Process(target=write_metrics, args=(queue,)) if rank == 0 else None
    if writer is not None:
        writer.start()
    for step in range(3):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if queue is not None:
            queue.put({"step": step, "loss": loss.item()})
    if writer is not None:
        queue.put(None)
        writer.join()
        queue.put({"histogram": [0.0] * 200_000})  # zoo: late_put
    dist.destroy_process_group()
    print(f"rank {rank}: training done")  # zoo: last_line


if __name__ == "__main__":
    main()
