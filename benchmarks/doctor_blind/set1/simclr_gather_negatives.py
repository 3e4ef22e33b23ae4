"""SimCLR-style NT-Xent training with negatives gathered from all ranks."""
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


class GatherLayer(torch.autograd.Function):
    """all_gather that lets gradients flow back to the rank that produced each slice."""

    @staticmethod
    def forward(ctx, x):
        out = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        all_grads = torch.stack(grads)
        dist.all_reduce(all_grads)
        return all_grads[dist.get_rank()]


def make_data(n=2048, dim=48, seed=5):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(64, dim, generator=g) * 2
    idx = torch.randint(0, 64, (n,), generator=g)
    return TensorDataset(centers[idx] + 0.3 * torch.randn(n, dim, generator=g))


def augment(x):
    mask = (torch.rand_like(x) > 0.15).float()
    return x * mask + 0.2 * torch.randn_like(x)


class Encoder(nn.Module):
    def __init__(self, dim=48, hidden=128, out=32):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.proj = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, out))

    def forward(self, x):
        return F.normalize(self.proj(self.backbone(x)), dim=-1)


def nt_xent(z1, z2, rank, tau=0.2):
    b = z1.size(0)
    all_z1 = torch.cat(GatherLayer.apply(z1), dim=0)
    all_z2 = torch.cat(GatherLayer.apply(z2), dim=0)
    labels = torch.arange(b) + rank * b
    logits_12 = z1 @ all_z2.t() / tau
    logits_21 = z2 @ all_z1.t() / tau
    return 0.5 * (F.cross_entropy(logits_12, labels) + F.cross_entropy(logits_21, labels))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)

    dataset = make_data()
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    model = DDP(Encoder())
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    torch.manual_seed(100 + rank)  # different augmentations on each rank

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for (x,) in loader:
            z1, z2 = model(torch.cat([augment(x), augment(x)])).chunk(2)
            loss = nt_xent(z1, z2, rank)
            optimizer.zero_grad()
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
