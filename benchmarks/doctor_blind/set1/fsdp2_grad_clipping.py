"""Regression MLP sharded with FSDP2 (fully_shard), with gradient-norm clipping."""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def make_dataset(n=2048, dim=32, seed=9):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, 1, generator=g)
    y = torch.sin(x @ w) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


class Regressor(nn.Module):
    def __init__(self, dim=32, hidden=256):
        super().__init__()
        self.layers = nn.ModuleList([
            nn.Linear(dim, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, hidden),
        ])
        self.out = nn.Linear(hidden, 1)

    def forward(self, x):
        for layer in self.layers:
            x = F.gelu(layer(x))
        return self.out(x)


@torch.no_grad()
def clip_gradients(model, max_norm):
    grads = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
    total_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    clip_coef = max_norm / (total_norm + 1e-6)
    if clip_coef < 1.0:
        for g in grads:
            g.mul_(clip_coef)
    return total_norm


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--max-norm", type=float, default=0.1)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)

    model = Regressor()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    dataset = make_dataset()
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            grad_norm = clip_gradients(model, args.max_norm)
            optimizer.step()
            step += 1
            if rank == 0 and step % 8 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} grad_norm {grad_norm.item():.3f}", flush=True)

    del model, optimizer
    dist.destroy_process_group()
    time.sleep(0.5)  # let gloo's background threads wind down before the interpreter exits


if __name__ == "__main__":
    main()
