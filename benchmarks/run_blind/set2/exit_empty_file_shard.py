"""File-sharded fine-tuning on 2 ranks: the training corpus is a list of synthetic data
files, each rank takes its share of the files, skips the job cleanly if it has nothing
to do, loads the samples of its files, and fine-tunes a DDP-wrapped MLP for a few
epochs before rank 0 reports the final loss."""
import datetime
import sys

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

FILES = ["corpus-000.pt"]
SAMPLES_PER_FILE = 256


def load_file(name):
    g = torch.Generator().manual_seed(sum(name.encode()))
    x = torch.randn(SAMPLES_PER_FILE, 12, generator=g)
    return x, x[:, :4].sum(dim=1, keepdim=True)


def my_samples(rank, world):
    files = FILES[rank::world]
    if not files:
        print(f"[rank {rank}] no files assigned, nothing to do", flush=True)
        sys.exit(0)
    parts = [load_file(f) for f in files]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def train(rank, world):
    x, y = my_samples(rank, world)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(3):
        for i in range(0, len(x), 32):
            loss = nn.functional.mse_loss(model(x[i:i + 32]), y[i:i + 32])
            opt.zero_grad()
            loss.backward()
            opt.step()
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f}", flush=True)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    train(dist.get_rank(), dist.get_world_size())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
