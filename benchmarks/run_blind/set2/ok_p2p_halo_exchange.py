"""Spatially partitioned 1-D convolution on 2 ranks: a long synthetic signal is split
into two halves, each rank owns one half, exchanges a halo of boundary samples with its
neighbour before every forward pass so the convolution sees its neighbour's edge, and
both ranks train the shared convolution weights with gradients averaged by all-reduce."""
import datetime

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401
import torch.nn as nn

HALO = 2
LENGTH = 512


def signal(seed=5):
    g = torch.Generator().manual_seed(seed)
    x = torch.cumsum(torch.randn(1, 1, LENGTH, generator=g), dim=-1) * 0.1
    y = torch.roll(x, shifts=-1, dims=-1)
    return x, y


def exchange_halo(local, rank):
    peer = 1 - rank
    edge = local[..., -HALO:] if rank == 0 else local[..., :HALO]
    halo = torch.empty_like(edge)
    if rank % 2 == 0:
        dist.send(edge.contiguous(), dst=peer)
        dist.recv(halo, src=peer)
    else:
        dist.recv(halo, src=peer)
        dist.send(edge.contiguous(), dst=peer)
    if rank == 0:
        return torch.cat([local, halo], dim=-1)
    return torch.cat([halo, local], dim=-1)


def train(rank, world):
    x, y = signal()
    half = LENGTH // world
    xl, yl = x[..., rank * half:(rank + 1) * half], y[..., rank * half:(rank + 1) * half]
    torch.manual_seed(0)
    conv = nn.Conv1d(1, 1, kernel_size=2 * HALO + 1, padding=HALO)
    opt = torch.optim.SGD(conv.parameters(), lr=0.05)
    for step in range(30):
        padded = exchange_halo(xl, rank)
        out = conv(padded)
        out = out[..., :half] if rank == 0 else out[..., HALO:]
        loss = nn.functional.mse_loss(out, yl)
        opt.zero_grad()
        loss.backward()
        for p in conv.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.5f}", flush=True)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    train(dist.get_rank(), dist.get_world_size())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
