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

EPOCHS = 2
BATCH_SIZE = 16


class AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x.contiguous())
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        all_grads = torch.stack(grads)
        dist.all_reduce(all_grads, op=dist.ReduceOp.SUM)
        return all_grads[dist.get_rank()]


def gather_features(x):
    return torch.cat(AllGather.apply(x), dim=0)


def make_pairs(n=1024, latent=12, dim_a=32, dim_b=24):
    g = torch.Generator().manual_seed(0)
    z = torch.randn(n, latent, generator=g)
    a = torch.tanh(z @ torch.randn(latent, dim_a, generator=g)) + 0.1 * torch.randn(n, dim_a, generator=g)
    b = z @ torch.randn(latent, dim_b, generator=g) + 0.1 * torch.randn(n, dim_b, generator=g)
    return TensorDataset(a, b)


class DualEncoder(nn.Module):
    def __init__(self, dim_a=32, dim_b=24, hidden=64, embed=16):
        super().__init__()
        self.enc_a = nn.Sequential(nn.Linear(dim_a, hidden), nn.GELU(), nn.Linear(hidden, embed))
        self.enc_b = nn.Sequential(nn.Linear(dim_b, hidden), nn.GELU(), nn.Linear(hidden, embed))
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, a, b):
        fa = F.normalize(self.enc_a(a), dim=-1)
        fb = F.normalize(self.enc_b(b), dim=-1)
        return fa, fb, self.logit_scale.exp().clamp(max=100)


def clip_loss(fa, fb, scale, rank):
    all_fa = gather_features(fa)
    all_fb = gather_features(fb)
    logits_a = scale * fa @ all_fb.T
    logits_b = scale * fb @ all_fa.T
    labels = torch.arange(fa.size(0), dtype=torch.long) + rank * fa.size(0)
    return 0.5 * (F.cross_entropy(logits_a, labels) + F.cross_entropy(logits_b, labels))


def train(rank, world_size):
    torch.manual_seed(0)
    model = DDP(DualEncoder())
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.05)

    dataset = make_pairs()
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler, drop_last=True)

    step = 0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for a, b in loader:
            fa, fb, scale = model(a, b)
            loss = clip_loss(fa, fb, scale, rank)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if rank == 0 and step % 16 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} scale {scale.item():.2f}")


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
