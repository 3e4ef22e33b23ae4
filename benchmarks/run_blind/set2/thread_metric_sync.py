"""Classifier training with live metrics on 2 ranks: a DDP-wrapped MLP is trained on
synthetic two-class data while a background metrics thread on every rank averages the
recent per-step losses across ranks and keeps a running global loss that rank 0 prints
at the end of each epoch."""
import datetime
import queue
import threading

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


class MetricSync(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.inbox = queue.Queue()
        self.global_loss = float("nan")

    def run(self):
        while True:
            item = self.inbox.get()
            if item is None:
                return
            t = torch.tensor([item])
            dist.all_reduce(t)
            self.global_loss = t.item() / dist.get_world_size()


def train(rank):
    sync = MetricSync()
    sync.start()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    for epoch in range(4):
        for step in range(20):
            x = torch.randn(32, 20, generator=g)
            y = (x[:, 0] > 0).long()
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sync.inbox.put(loss.item())
        if rank == 0:
            print(f"epoch {epoch} global loss {sync.global_loss:.4f}", flush=True)
    sync.inbox.put(None)
    sync.join()


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    train(dist.get_rank())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
