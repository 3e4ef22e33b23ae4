"""DDP where rank 1's DataLoader workers spend ~20 s in worker_init_fn.

Mechanism (a), HEALTHY. Rank 1 starts 2 DataLoader workers whose
worker_init_fn rebuilds a lookup table (pure CPU, ~20 s, each worker on its own
core). Rank 1's main thread waits for the first batch; rank 0 got its batches
at once and waits in DDP's gradient all-reduce of step 0. Once rank 1's workers
are ready, training proceeds normally and both ranks exit 0.

Drawn from: https://github.com/pytorch/pytorch/issues/82077
("Using DDP with num_workers > 0 hangs before entering the first training epoch
loop" -- the reporters' workers were slow to start; the first epoch "will
experience slow startup, as the workers will be slow when starting").
"""
import os
import time

import torch.distributed.nn  # noqa: F401  (imported before init on purpose)
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

TABLE_SECONDS = 20.0


class Tokens(Dataset):
    def __init__(self, n=512, dim=24):
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(n, dim, generator=g)
        self.y = (self.x.sum(dim=1, keepdim=True) > 0).float()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def rebuild_table(worker_id):
    # Only the shard owned by rank 1 is "stale" and needs its table rebuilt.
    if os.environ.get("RANK") != "1":
        return
    deadline = time.monotonic() + TABLE_SECONDS
    table = {}
    k = 0
    while time.monotonic() < deadline:
        k += 1
        table[k % 50021] = (k * 2654435761) % (1 << 32)
    print(f"[rank 1 worker {worker_id}] table rebuilt ({len(table)} keys)", flush=True)


def train(rank, world):
    ds = Tokens()
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=3)
    loader = DataLoader(ds, batch_size=16, sampler=sampler, num_workers=2,
                        worker_init_fn=rebuild_table)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(24, 48), nn.Tanh(), nn.Linear(48, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    lossf = nn.BCEWithLogitsLoss()
    t0 = time.time()
    # One epoch only: a second epoch would start fresh workers and rebuild again.
    sampler.set_epoch(0)
    for i, (xb, yb) in enumerate(loader):  # zoo: first-batch
        if i == 0:
            # Whole seconds: the differential test compares what both launchers' runs printed,
            # and tenths moved with the machine's load (0.1-0.2 s, 20.0-20.1 s).
            print(f"[rank {rank}] first batch after {time.time() - t0:.0f}s", flush=True)
        opt.zero_grad()
        loss = lossf(model(xb), yb)
        loss.backward()  # zoo: peer-wait
        opt.step()
    print(f"[rank {rank}] {i + 1} steps, loss {loss.item():.3f}", flush=True)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    dist.barrier()
    dist.destroy_process_group()
