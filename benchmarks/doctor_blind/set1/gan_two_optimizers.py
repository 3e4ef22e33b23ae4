"""Small GAN on a 2-D Gaussian-mixture toy distribution; generator and discriminator both wrapped in DDP."""
import argparse
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


def ring_of_gaussians(n=4096, modes=8, radius=2.0, std=0.05, seed=6):
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(0, modes, (n,), generator=g).float()
    angle = 2 * math.pi * k / modes
    centers = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=1)
    return TensorDataset(centers + std * torch.randn(n, 2, generator=g))


class Generator(nn.Module):
    def __init__(self, z_dim=16, hidden=128):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(z_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, 2))

    def forward(self, z):
        return self.net(z)


class Discriminator(nn.Module):
    def __init__(self, hidden=128):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, hidden),
                                 nn.LeakyReLU(0.2), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.net(x)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--z-dim", type=int, default=16)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)

    netG = DDP(Generator(args.z_dim))
    netD = DDP(Discriminator())
    opt_g = torch.optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(netD.parameters(), lr=2e-4, betas=(0.5, 0.999))

    dataset = ring_of_gaussians()
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    torch.manual_seed(50 + rank)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for (real,) in loader:
            b = real.size(0)
            fake = netG(torch.randn(b, args.z_dim))

            # discriminator update
            logits = netD(torch.cat([real, fake.detach()]))
            targets = torch.cat([torch.ones(b, 1), torch.zeros(b, 1)])
            d_loss = F.binary_cross_entropy_with_logits(logits, targets)
            d_loss.backward()
            opt_d.step()
            opt_d.zero_grad()

            # generator update
            g_loss = F.binary_cross_entropy_with_logits(netD(fake), torch.ones(b, 1))
            g_loss.backward()
            opt_g.step()
            opt_g.zero_grad()

            step += 1
            if rank == 0 and step % 8 == 0:
                print(f"step {step} d_loss {d_loss.item():.4f} g_loss {g_loss.item():.4f}", flush=True)

    del netG, netD, opt_g, opt_d
    dist.destroy_process_group()
    time.sleep(0.5)  # let gloo's background threads wind down before the interpreter exits


if __name__ == "__main__":
    main()
