"""A hang that a busy helper thread must not hide. Each rank runs a background prefetcher thread
that augments images for its first 60 s (its warm-up budget), using about a third of a core. At
step 3 rank 0 saves a checkpoint and calls `dist.barrier()` inside `if rank == 0:`, while rank 1
goes on to the next step's gradient all-reduce: a hang. The prefetchers' CPU is not progress while
the main threads wait in collectives, so the hang is diagnosed at the stall timeout, long before
the prefetchers stop. Plain torchrun hangs."""

import argparse
import os
import tempfile
import threading
import time
from collections import deque

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def augment(image: torch.Tensor) -> torch.Tensor:
    """Flip, blur and squash: stands in for decoding and augmenting one image."""
    return F.avg_pool2d(image.flip(1)[None, None], 3, stride=1, padding=1).tanh()[0, 0]


def prefetch(rank: int, seconds: float, cache: deque) -> None:
    """Keeps `cache` topped up with freshly augmented batches (about 5 ms of CPU each, then a
    10 ms nap) until its time budget is spent: about a third of a core."""
    gen = torch.Generator().manual_seed(rank)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        cache.append([augment(torch.randn(256, 256, generator=gen)) for _ in range(3)])  # zoo: augment
        time.sleep(0.01)
    print(f"rank {rank}: PREFETCHER STOPS AT {time.time():.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-at", type=int, default=3)
    parser.add_argument("--prefetch-seconds", type=float, default=60.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    cache: deque = deque(maxlen=32)
    threading.Thread(target=prefetch, args=(rank, args.prefetch_seconds, cache), daemon=True).start()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)
    ckpt_path = os.path.join(tempfile.gettempdir(), "zoo_busy_thread_masks_hang.pt")
    for step in range(1, args.steps + 1):  # steps counted from 1
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()  # zoo: backward
        opt.step()
        if step == args.save_at and rank == 0:
            torch.save(model.state_dict(), ckpt_path)
            print(f"rank {rank}: HANG STARTS AT {time.time():.3f}", flush=True)
            dist.barrier()  # zoo: barrier
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
