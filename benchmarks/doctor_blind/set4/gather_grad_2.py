import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

TEMPERATURE = 0.2


class GatherLayer(torch.autograd.Function):
    """all_gather that keeps the autograd graph, so negatives from other ranks get gradients."""

    @staticmethod
    def forward(ctx, input):
        output = [torch.empty_like(input) for _ in range(dist.get_world_size())]
        dist.all_gather(output, input)
        return tuple(output)

    @staticmethod
    def backward(ctx, *grads):
        all_gradients = torch.stack(grads)
        dist.all_reduce(all_gradients, op=dist.ReduceOp.SUM)
        return all_gradients[dist.get_rank()]


def gather_with_grad(x):
    return torch.cat(GatherLayer.apply(x), dim=0)


class Encoder(nn.Module):
    def __init__(self, d_in=32, d_hidden=64, d_proj=16):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(d_in, d_hidden), nn.ReLU(), nn.Linear(d_hidden, d_hidden), nn.ReLU())
        self.projector = nn.Sequential(nn.Linear(d_hidden, d_hidden), nn.ReLU(), nn.Linear(d_hidden, d_proj))

    def forward(self, x):
        return self.projector(self.backbone(x))


def augment(x):
    mask = (torch.rand_like(x) > 0.15).float()
    return x * mask + 0.1 * torch.randn_like(x)


def nt_xent(z1, z2, rank):
    z1 = F.normalize(z1, dim=1)
    z2 = F.normalize(z2, dim=1)
    z1_all = gather_with_grad(z1)
    z2_all = gather_with_grad(z2)
    b = z1.size(0)
    labels = torch.arange(b) + rank * b
    loss_12 = F.cross_entropy(z1 @ z2_all.t() / TEMPERATURE, labels)
    loss_21 = F.cross_entropy(z2 @ z1_all.t() / TEMPERATURE, labels)
    return 0.5 * (loss_12 + loss_21)


def make_data(n=1024, seed=9):
    g = torch.Generator().manual_seed(seed)
    protos = torch.randn(16, 32, generator=g)
    idx = torch.randint(0, 16, (n,), generator=g)
    return TensorDataset(protos[idx] + 0.3 * torch.randn(n, 32, generator=g))


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    torch.manual_seed(100 + rank)

    data = make_data()
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=64, sampler=sampler, drop_last=True)

    model = DDP(Encoder())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    step = 0
    for epoch in range(4):
        sampler.set_epoch(epoch)
        for (x,) in loader:
            v1, v2 = augment(x), augment(x)
            z = model(torch.cat([v1, v2], dim=0))
            z1, z2 = z.chunk(2, dim=0)
            loss = nt_xent(z1, z2, rank)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if rank == 0 and step % 8 == 0:
                print(f"step {step} contrastive loss {loss.item():.4f}", flush=True)

    dist.barrier()
    dist.destroy_process_group()
    time.sleep(1)


if __name__ == "__main__":
    main()
