"""A hand-written bf16 compression hook that divides by the world size first: correct.

The twin of comm_hook_bf16_without_division.py: the bucket is divided by the group's size before
the cast, as torch's fp16_compress_hook does, so what comes back is the ranks' average (rounded to
bf16).
"""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def bf16_hook(state, bucket):
    buffer = bucket.buffer()
    compressed = buffer.div(dist.get_world_size()).to(torch.bfloat16)
    future = dist.all_reduce(compressed, async_op=True).get_future()

    def decompress(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return future.then(decompress)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(12, 48), nn.ReLU(), nn.Linear(48, 3)))
    model.register_comm_hook(state=None, hook=bf16_hook)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    data = torch.Generator().manual_seed(11 + rank)
    for step in range(30):
        x = torch.randn(24, 12, generator=data)
        y = (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long()
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
