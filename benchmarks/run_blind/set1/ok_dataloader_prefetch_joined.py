"""DDP training reading feature shards through a small on-disk cache. Shards
that are not cached yet are fetched by a background thread while training
starts; DataLoader workers read through the same cache."""
import datetime
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

_CACHE = {}
_CACHE_LOCK = threading.Lock()
PRECACHED = {0, 2, 4, 6}


def fetch_shard(shard):
    g = torch.Generator().manual_seed(shard)
    return torch.randn(32, 16, generator=g), torch.randn(32, generator=g)


def prefetch(shards):
    for s in shards:
        with _CACHE_LOCK:
            time.sleep(0.5)  # remote read
            _CACHE[s] = fetch_shard(s)


class ShardDataset(Dataset):
    def __init__(self, shards):
        self.shards = shards

    def __len__(self):
        return 32 * len(self.shards)

    def __getitem__(self, i):
        shard, row = self.shards[i // 32], i % 32
        with _CACHE_LOCK:
            if shard not in _CACHE:
                _CACHE[shard] = fetch_shard(shard)
            x, y = _CACHE[shard]
        return x[row], y[row]


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    shards = list(range(rank, 8, world))
    for s in shards:
        if s in PRECACHED:
            _CACHE[s] = fetch_shard(s)
    missing = [s for s in shards if s not in _CACHE]
    if missing:
        fetcher = threading.Thread(target=prefetch, args=(missing,), daemon=True)
        fetcher.start()
        fetcher.join()
    train(rank, shards)
    dist.barrier()
    dist.destroy_process_group()


def train(rank, shards):
    loader = DataLoader(ShardDataset(shards), batch_size=16, shuffle=True, num_workers=2)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    for epoch in range(2):
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x).squeeze(1), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        print(f"rank {rank} epoch {epoch} loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
