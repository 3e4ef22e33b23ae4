import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

SEED = 123


class RandomFourierFeatures(nn.Module):
    """Fixed (non-trainable) random Fourier feature map."""

    def __init__(self, d_in, n_features, sigma=1.0):
        super().__init__()
        self.register_buffer("omega", torch.randn(d_in, n_features) / sigma)
        self.register_buffer("phase", 2 * math.pi * torch.rand(n_features))

    def forward(self, x):
        return torch.cos(x @ self.omega + self.phase) * math.sqrt(2.0 / self.omega.shape[1])


def make_data(n=640, seed=77):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 2, generator=g) * 4 - 2
    y = torch.sin(2 * x[:, 0]) * torch.cos(1.5 * x[:, 1]) + 0.05 * torch.randn(n, generator=g)
    return TensorDataset(x, y)


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    # different seed per process so the input jitter differs between ranks
    torch.manual_seed(SEED + rank)

    data = make_data()
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=SEED)
    loader = DataLoader(data, batch_size=32, sampler=sampler, drop_last=True)

    featurizer = RandomFourierFeatures(2, 128, sigma=0.7)
    head = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 1))
    model = DDP(nn.Sequential(featurizer, head))
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)

    for epoch in range(4):
        sampler.set_epoch(epoch)
        total = 0.0
        for x, y in loader:
            x = x + 0.02 * torch.randn_like(x)
            pred = model(x).squeeze(-1)
            loss = F.mse_loss(pred, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item()
        if rank == 0:
            print(f"epoch {epoch} mse {total / len(loader):.4f}", flush=True)

    dist.barrier()
    dist.destroy_process_group()
    time.sleep(1)


if __name__ == "__main__":
    main()
