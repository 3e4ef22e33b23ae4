"""BYOL-style self-supervised training: online network + slowly moving target network."""
import argparse
import copy
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def make_data(n=2048, dim=48, clusters=32, seed=13):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(clusters, dim, generator=g) * 2
    idx = torch.randint(0, clusters, (n,), generator=g)
    return TensorDataset(centers[idx] + 0.3 * torch.randn(n, dim, generator=g))


def augment(x):
    return x * (torch.rand_like(x) > 0.2).float() + 0.1 * torch.randn_like(x)


def mlp(inp, hidden, out):
    return nn.Sequential(nn.Linear(inp, hidden), nn.ReLU(), nn.Linear(hidden, out))


class Online(nn.Module):
    def __init__(self, dim=48, hidden=128, proj=32):
        super().__init__()
        self.encoder = mlp(dim, hidden, hidden)
        self.projector = mlp(hidden, hidden, proj)
        self.predictor = mlp(proj, hidden, proj)

    def forward(self, x):
        return self.predictor(self.projector(self.encoder(x)))


class Target(nn.Module):
    def __init__(self, online):
        super().__init__()
        self.encoder = copy.deepcopy(online.encoder)
        self.projector = copy.deepcopy(online.projector)
        for p in self.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def forward(self, x):
        return self.projector(self.encoder(x))


@torch.no_grad()
def momentum_update(target, online, tau):
    for t_mod, o_mod in ((target.encoder, online.encoder), (target.projector, online.projector)):
        for pt, po in zip(t_mod.parameters(), o_mod.parameters()):
            pt.mul_(tau).add_(po.detach(), alpha=1 - tau)


def byol_loss(p, z):
    return 2 - 2 * F.cosine_similarity(p, z.detach(), dim=-1).mean()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--tau", type=float, default=0.99)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)

    online = Online()
    target = Target(online)
    model = DDP(online)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    dataset = make_data()
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    torch.manual_seed(77 + rank)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for (x,) in loader:
            v1, v2 = augment(x), augment(x)
            p = model(torch.cat([v1, v2]))
            z = target(torch.cat([v2, v1]))
            loss = byol_loss(p, z)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if rank == 0:
                momentum_update(target, model.module, args.tau)
                if step % 8 == 0:
                    print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)

    del model, optimizer
    dist.destroy_process_group()
    time.sleep(0.5)  # let gloo's background threads wind down before the interpreter exits


if __name__ == "__main__":
    main()
