"""Healthy: per-rank seeding for augmentation, but random_split with its own seeded generator, so every
rank holds the same train/val split. DistributedSampler(train_set, shuffle=True, seed=0) with
set_epoch; each epoch first lists the sampler's indices to warm a cache (a second pass over the
sampler in the same epoch, which yields the same order), then iterates the DataLoader. Every rank
evaluates the whole validation set and the sums are all-reduced. Nothing to report."""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, TensorDataset, random_split
from torch.utils.data.distributed import DistributedSampler


class CachedDataset(Dataset):
    """Normalizes samples on demand and keeps them; warm() precomputes the ones an epoch will use."""

    def __init__(self, base: Dataset) -> None:
        self.base = base
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self.base)

    def warm(self, indices: list[int]) -> None:
        for i in indices:
            self[i]

    def __getitem__(self, i: int):
        if i not in self.cache:
            x, y = self.base[i]
            self.cache[i] = ((x - x.mean()) / (x.std() + 1e-6), y)
        return self.cache[i]


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(1000 + rank)  # different augmentation noise on each rank
    gen = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(320, 16, generator=gen), torch.randn(320, 1, generator=gen))
    train_set, val_set = random_split(dataset, [0.8, 0.2], generator=torch.Generator().manual_seed(42))
    train_set = CachedDataset(train_set)
    sampler = DistributedSampler(train_set, shuffle=True, seed=0)  # 128 samples, 8 batches per rank
    loader = DataLoader(train_set, batch_size=16, sampler=sampler)
    val_loader = DataLoader(val_set, batch_size=32)

    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        order = list(sampler)
        train_set.warm(order)
        ddp.train()
        for x, y in loader:
            x = x + 0.05 * torch.randn_like(x)
            loss = F.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        ddp.eval()
        total = torch.zeros(2)
        with torch.no_grad():
            for x, y in val_loader:
                total += torch.tensor([F.mse_loss(model(x), y, reduction="sum").item(), len(y)])
        dist.all_reduce(total)
        val_loss = (total[0] / total[1]).item()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
