"""VQ-VAE on synthetic vectors with an EMA-updated codebook (van den Oord et al.), trained with DDP."""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class EMAQuantizer(nn.Module):
    def __init__(self, num_codes=64, dim=16, decay=0.95, eps=1e-5):
        super().__init__()
        self.decay, self.eps, self.num_codes = decay, eps, num_codes
        embed = torch.randn(num_codes, dim)
        self.register_buffer("embed", embed)
        self.register_buffer("cluster_size", torch.ones(num_codes))
        self.register_buffer("embed_avg", embed.clone())

    def forward(self, z):
        dist_sq = (z.pow(2).sum(1, keepdim=True) - 2 * z @ self.embed.t() + self.embed.pow(2).sum(1))
        codes = dist_sq.argmin(dim=1)
        quantized = F.embedding(codes, self.embed)
        if self.training:
            with torch.no_grad():
                onehot = F.one_hot(codes, self.num_codes).type_as(z)
                counts = onehot.sum(0)
                embed_sum = onehot.t() @ z.detach()
                self.cluster_size.mul_(self.decay).add_(counts, alpha=1 - self.decay)
                self.embed_avg.mul_(self.decay).add_(embed_sum, alpha=1 - self.decay)
                n = self.cluster_size.sum()
                size = (self.cluster_size + self.eps) / (n + self.num_codes * self.eps) * n
                self.embed.copy_(self.embed_avg / size.unsqueeze(1))
        commit = F.mse_loss(z, quantized.detach())
        quantized = z + (quantized - z).detach()
        return quantized, commit, codes


class VQVAE(nn.Module):
    def __init__(self, dim=64, hidden=128, code_dim=16):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, code_dim))
        self.vq = EMAQuantizer(dim=code_dim)
        self.dec = nn.Sequential(nn.Linear(code_dim, hidden), nn.ReLU(), nn.Linear(hidden, dim))

    def forward(self, x):
        q, commit, codes = self.vq(self.enc(x))
        return self.dec(q), commit, codes


def make_data(n=4096, dim=64, clusters=48, seed=31):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(clusters, dim, generator=g)
    idx = torch.randint(0, clusters, (n,), generator=g)
    return TensorDataset(centers[idx] + 0.1 * torch.randn(n, dim, generator=g))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--beta", type=float, default=0.25)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)

    model = DDP(VQVAE())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    dataset = make_data()
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for (x,) in loader:
            recon, commit, codes = model(x)
            loss = F.mse_loss(recon, x) + args.beta * commit
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if rank == 0 and step % 8 == 0:
                used = codes.unique().numel()
                print(f"step {step} loss {loss.item():.4f} codes used {used}", flush=True)

    del model, optimizer
    dist.destroy_process_group()
    time.sleep(0.5)  # let gloo's background threads wind down before the interpreter exits


if __name__ == "__main__":
    main()
