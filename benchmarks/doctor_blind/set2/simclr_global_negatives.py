import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

EPOCHS = 2
BATCH_SIZE = 16
TEMPERATURE = 0.2


class GatherLayer(torch.autograd.Function):
    """all_gather that keeps the autograd graph."""

    @staticmethod
    def forward(ctx, x):
        out = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x.contiguous())
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        all_grads = torch.stack(grads)
        dist.all_reduce(all_grads, op=dist.ReduceOp.SUM)
        return all_grads[dist.get_rank()]


def make_dataset(n=1024, dim=32, clusters=8):
    g = torch.Generator().manual_seed(0)
    centers = 2.0 * torch.randn(clusters, dim, generator=g)
    idx = torch.randint(0, clusters, (n,), generator=g)
    x = centers[idx] + 0.5 * torch.randn(n, dim, generator=g)
    return TensorDataset(x)


def augment(x):
    mask = (torch.rand_like(x) > 0.2).to(x.dtype)
    return x * mask + 0.3 * torch.randn_like(x)


class Encoder(nn.Module):
    def __init__(self, dim=32, hidden=64, proj=16):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.projector = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, proj))

    def forward(self, x):
        return self.projector(self.backbone(x))


def nt_xent(z1, z2, rank):
    z1 = F.normalize(z1, dim=1)
    z2 = F.normalize(z2, dim=1)
    z1_all = torch.cat(GatherLayer.apply(z1), dim=0)
    z2_all = torch.cat(GatherLayer.apply(z2), dim=0)
    b = z1.size(0)
    labels = torch.arange(b) + rank * b
    self_mask = F.one_hot(labels, z1_all.size(0)).bool()
    l12 = z1 @ z2_all.T / TEMPERATURE
    l11 = (z1 @ z1_all.T / TEMPERATURE).masked_fill(self_mask, -1e9)
    l21 = z2 @ z1_all.T / TEMPERATURE
    l22 = (z2 @ z2_all.T / TEMPERATURE).masked_fill(self_mask, -1e9)
    loss_a = F.cross_entropy(torch.cat([l12, l11], dim=1), labels)
    loss_b = F.cross_entropy(torch.cat([l21, l22], dim=1), labels)
    return 0.5 * (loss_a + loss_b)


def train(rank, world_size):
    torch.manual_seed(0)
    model = DDP(Encoder())
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-4)
    torch.manual_seed(100 + rank)

    dataset = make_dataset()
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler, drop_last=True)

    step = 0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for (x,) in loader:
            z1 = model(augment(x))
            z2 = model(augment(x))
            loss = nt_xent(z1, z2, rank)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if rank == 0 and step % 16 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}")


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
