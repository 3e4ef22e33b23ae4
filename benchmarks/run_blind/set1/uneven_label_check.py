"""DDP classifier over per-rank shards with a sanity check on each batch's
labels before the step."""
import datetime

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

NUM_CLASSES = 5


def shard(rank, steps=8):
    g = torch.Generator().manual_seed(10 + rank)
    out = []
    for s in range(steps):
        x = torch.randn(12, 6, generator=g)
        y = torch.randint(0, NUM_CLASSES, (12,), generator=g)
        if rank == 1 and s == 3:
            y[4] = NUM_CLASSES
        out.append((x, y))
    return out


def check_batch(y, step):
    if int(y.max()) >= NUM_CLASSES or int(y.min()) < 0:
        raise ValueError(f"step {step}: label out of range [0, {NUM_CLASSES}): {y.tolist()}")


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, NUM_CLASSES)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, (x, y) in enumerate(shard(rank)):
        check_batch(y, step)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"rank {rank} done loss {loss.item():.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
