"""Training with an out-of-process metrics writer on 2 ranks: rank 0 starts a writer
process fed through a multiprocessing queue, both ranks train a DDP-wrapped MLP on
synthetic data, rank 0 streams per-step scalars and a final weight histogram to the
writer, and the job ends after a last synchronisation."""
import datetime
import multiprocessing as mp
import os
import tempfile

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

LOG_PATH = os.path.join(tempfile.gettempdir(), f"metrics_{os.environ.get('TORCHELASTIC_RUN_ID', 'x')}.log")


def writer_main(q, path):
    with open(path, "w") as f:
        while True:
            item = q.get()
            if item is None:
                break
            kind, payload = item
            if kind == "scalar":
                f.write(f"{payload[0]} {payload[1]:.5f}\n")
            else:
                f.write(f"hist {len(payload)}\n")


class MetricsWriter:
    def __init__(self):
        ctx = mp.get_context("fork")
        self.q = ctx.Queue()
        self.proc = ctx.Process(target=writer_main, args=(self.q, LOG_PATH), daemon=True)
        self.proc.start()

    def scalar(self, step, value):
        self.q.put(("scalar", (step, value)))

    def histogram(self, values):
        self.q.put(("hist", values))

    def close(self):
        self.q.put(None)
        self.proc.join(timeout=10)


def train(rank):
    writer = MetricsWriter() if rank == 0 else None
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    for step in range(40):
        x = torch.randn(32, 32, generator=g)
        loss = nn.functional.mse_loss(model(x), x.mean(dim=1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if writer is not None:
            writer.scalar(step, loss.item())
    if writer is not None:
        writer.close()
        weights = np.concatenate([p.detach().numpy().ravel() for p in model.parameters()])
        writer.histogram(np.repeat(weights, 4))
        print(f"final loss {loss.item():.4f}", flush=True)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    train(dist.get_rank())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
