"""SimCLR-style contrastive training of a small MLP encoder with DDP, using negatives gathered from all ranks."""
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


class GatherLayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z):
        buckets = [torch.zeros_like(z) for _ in range(dist.get_world_size())]
        dist.all_gather(buckets, z)
        return tuple(buckets)

    @staticmethod
    def backward(ctx, *grads):
        stacked = torch.stack(grads)
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM)
        return stacked[dist.get_rank()]


def gather_features(z, rank, world_size):
    buckets = GatherLayer.apply(z)
    return torch.cat(buckets, dim=0)


def augment(x):
    return x * (1.0 + 0.1 * torch.randn_like(x)) + 0.1 * torch.randn_like(x)


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    torch.manual_seed(0)

    encoder = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    model = DDP(encoder)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    temperature = 0.2

    gen = torch.Generator().manual_seed(300 + rank)
    prototypes = torch.randn(64, 32, generator=torch.Generator().manual_seed(8))
    torch.manual_seed(50 + rank)
    for step in range(40):
        idx = torch.randint(0, 64, (24,), generator=gen)
        x = prototypes[idx] + 0.2 * torch.randn(24, 32, generator=gen)
        z1 = F.normalize(model(augment(x)), dim=1)
        z2 = F.normalize(model(augment(x)), dim=1)

        all_z2 = gather_features(z2, rank, world_size)
        logits = z1 @ all_z2.t() / temperature
        targets = torch.arange(z1.shape[0]) + rank * z1.shape[0]
        loss = F.cross_entropy(logits, targets)

        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step} contrastive loss {loss.item():.4f}")

    dist.barrier()
    dist.destroy_process_group()
    time.sleep(1)


if __name__ == "__main__":
    main()
