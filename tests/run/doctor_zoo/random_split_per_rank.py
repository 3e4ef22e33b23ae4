"""torch.manual_seed(rank) early (per-rank augmentation noise), then random_split without a generator:
the split draws from the per-rank global generator, so each rank has its own train/val split. The
DistributedSampler slices a different train set on each rank, and every rank trains on samples that
another rank's validation set holds: the validation loss is measured partly on training data.
Nothing fails."""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset, random_split
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(rank)  # different augmentation noise on each rank
    gen = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(320, 16, generator=gen), torch.randn(320, 1, generator=gen))
    train_set, val_set = random_split(dataset, [0.8, 0.2])  # doctor: split
    sampler = DistributedSampler(train_set, shuffle=True, seed=0)  # 128 samples, 8 batches per rank
    loader = DataLoader(train_set, batch_size=16, sampler=sampler)
    val_loader = DataLoader(val_set, batch_size=32)

    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for epoch in range(2):
        sampler.set_epoch(epoch)
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
