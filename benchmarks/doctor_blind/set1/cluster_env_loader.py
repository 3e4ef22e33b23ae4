"""1D-CNN sequence classifier; launcher-agnostic data sharding."""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class SyntheticSequences(Dataset):
    def __init__(self, n=1536, length=64, channels=4, seed=7):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, channels, length, generator=g)
        freq = torch.randint(0, 3, (n,), generator=g)
        t = torch.linspace(0, 6.28, length)
        for i in range(n):
            self.x[i, 0] += torch.sin(t * (freq[i] + 1))
        self.y = freq

    def __len__(self):
        return len(self.y)

    def __getitem__(self, idx):
        return self.x[idx], self.y[idx]


class ConvNet(nn.Module):
    def __init__(self, channels=4, classes=3):
        super().__init__()
        self.conv1 = nn.Conv1d(channels, 32, 5, padding=2)
        self.conv2 = nn.Conv1d(32, 64, 5, padding=2)
        self.head = nn.Linear(64, classes)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool1d(x, 2)
        x = F.relu(self.conv2(x))
        x = x.mean(dim=-1)
        return self.head(x)


def data_shard_info():
    """Task index and task count as exported by the cluster launcher."""
    shard_rank = int(os.environ.get("SLURM_PROCID", 0))
    num_shards = int(os.environ.get("SLURM_NTASKS", os.environ.get("WORLD_SIZE", 1)))
    return shard_rank, num_shards


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)

    dataset = SyntheticSequences()
    shard_rank, num_shards = data_shard_info()
    sampler = DistributedSampler(dataset, num_replicas=num_shards, rank=shard_rank, shuffle=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    model = DDP(ConvNet())
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if rank == 0 and step % 8 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)

    del model, optimizer
    dist.destroy_process_group()
    time.sleep(0.5)  # let gloo's background threads wind down before the interpreter exits


if __name__ == "__main__":
    main()
