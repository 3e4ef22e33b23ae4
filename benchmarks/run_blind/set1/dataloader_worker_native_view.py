"""DDP image-regression job. Samples live in one contiguous host buffer and
the Dataset hands out zero-copy views into it by offset."""
import ctypes
import datetime

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

FEATS = 64


class PackedDataset(Dataset):
    def __init__(self, n=48):
        g = torch.Generator().manual_seed(0)
        self.blob = torch.randn(n * FEATS, generator=g)
        self.targets = torch.randn(n, generator=g)
        base = self.blob.data_ptr()
        self.addr = [0] * n
        for i in range(n):
            if i % 31 != 17:  # entries dropped by the upstream filter
                self.addr[i] = base + i * FEATS * 4

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, i):
        view = (ctypes.c_float * FEATS).from_address(self.addr[i])
        x = torch.tensor(list(view))
        return x, self.targets[i]


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    ds = PackedDataset()
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=False)
    loader = DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2)
    model = DDP(nn.Sequential(nn.Linear(FEATS, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x).squeeze(1), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        print(f"rank {rank} epoch {epoch} loss {loss.item():.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
