import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

LATENT = 8
DIM = 2
EPOCHS = 2
BATCH_SIZE = 32


def ring_of_gaussians(n=2048, modes=8):
    g = torch.Generator().manual_seed(0)
    k = torch.randint(0, modes, (n,), generator=g).float()
    angle = 2 * torch.pi * k / modes
    centers = torch.stack([torch.cos(angle), torch.sin(angle)], dim=1) * 2.0
    return TensorDataset(centers + 0.05 * torch.randn(n, DIM, generator=g))


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(LATENT, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, DIM))

    def forward(self, z):
        return self.net(z)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(DIM, 64), nn.LeakyReLU(0.2), nn.Linear(64, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))

    def forward(self, x):
        return self.net(x)


def train(rank, world_size):
    torch.manual_seed(0)
    gen = DDP(Generator())
    disc = DDP(Discriminator())
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3, betas=(0.5, 0.999))
    torch.manual_seed(1000 + rank)

    dataset = ring_of_gaussians()
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler, drop_last=True)

    step = 0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for (real,) in loader:
            z = torch.randn(real.size(0), LATENT)
            fake = gen(z)

            # discriminator update
            logits = disc(torch.cat([real, fake.detach()], dim=0))
            targets = torch.cat([torch.ones(real.size(0), 1), torch.zeros(real.size(0), 1)], dim=0)
            d_loss = F.binary_cross_entropy_with_logits(logits, targets)
            opt_d.zero_grad()
            d_loss.backward()
            opt_d.step()

            # generator update
            g_loss = F.binary_cross_entropy_with_logits(disc(fake), torch.ones(real.size(0), 1))
            opt_g.zero_grad()
            g_loss.backward()
            opt_g.step()

            step += 1
            if rank == 0 and step % 16 == 0:
                print(f"epoch {epoch} step {step} d_loss {d_loss.item():.4f} g_loss {g_loss.item():.4f}")


def main():
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    train(rank, world_size)
    dist.destroy_process_group()
    time.sleep(0.5)


if __name__ == "__main__":
    main()
