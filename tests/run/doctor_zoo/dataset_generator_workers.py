"""A Dataset that augments with its own NumPy generator, created once in __init__ and never reseeded
(no worker_init_fn). Every DataLoader worker gets a copy of the same generator state, again at every
epoch (persistent_workers=False), and on every rank: each worker, epoch and rank adds the same noise
sequence, so the "random" augmentation repeats instead of varying. Nothing fails."""

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class NoisyDataset(Dataset):
    def __init__(self, n: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 16, generator=gen)
        self.y = torch.randn(n, 1, generator=gen)
        self.rng = np.random.default_rng(0)  # doctor: rng

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        noise = self.rng.normal(0.0, 0.1, size=16).astype(np.float32)
        return self.x[i] + torch.from_numpy(noise), self.y[i]


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    dataset = NoisyDataset(128)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)  # 64 samples, 4 batches per rank
    loader = DataLoader(dataset, batch_size=16, sampler=sampler, num_workers=2, persistent_workers=False)

    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for epoch in range(4):
        sampler.set_epoch(epoch)
        for x, y in loader:  # doctor: loop
            loss = F.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
