"""HEALTHY look-alike: IterableDataset sharded over (rank, worker) pairs.

Looks suspicious: an IterableDataset with no DistributedSampler, whose
`__iter__` picks shards with `get_worker_info()` (the pattern of
`iterable_worker_shard_only.py`), and the same shuffled shard order on every
rank (seeded by the epoch only).

Why it is correct: the shard stride is `world * num_workers` and the offset is
`rank * num_workers + worker_id`, so the 4 (rank, worker) readers get
disjoint shard sets that together cover all 16 shards each epoch; the shared
shuffle seed is intentional (all readers must agree on the order before
striding). Every rank sees 8 shards x 32 samples = 16 batches per epoch, so
step counts match and DDP does not hang.

Public report: https://github.com/huggingface/transformers/pull/11254 (shard
an IterableDataset per process; shuffle with the same seed on all processes).

Expected verdict (ideal checker): no finding. The shard-selection line is
marked with the zoo lookalike marker.

Plain torchrun (measured, `torchrun --standalone --nproc-per-node 2`, CPU,
gloo): exit 0, 32 steps/rank, ~10-25 s. Consumed-sample checksums rank 0 =
41012992, rank 1 = 48203520 (sum 89216512 = 2 epochs x the full dataset,
disjoint); parameter checksum -0.92735372 on both ranks.
"""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, get_worker_info


class ShardStream(IterableDataset):
    def __init__(self, n_shards=8, per_shard=64, epoch=0, rank=0, world=1):
        self.rank, self.world = rank, world
        self.shards = list(range(n_shards))
        self.per_shard = per_shard
        self.epoch = epoch

    def read_shard(self, sid):
        g = torch.Generator().manual_seed(500 + sid)
        x = torch.randn(self.per_shard, 10, generator=g)
        y = (x[:, 0] * x[:, 1] > 0).long()
        ids = torch.arange(self.per_shard) + sid * self.per_shard
        for i in range(self.per_shard):
            yield x[i], y[i], ids[i]

    def __iter__(self):
        info = get_worker_info()
        order = torch.randperm(len(self.shards), generator=torch.Generator().manual_seed(self.epoch)).tolist()
        shards = [self.shards[i] for i in order]
        num_workers, wid = (info.num_workers, info.id) if info is not None else (1, 0)
        shards = shards[self.rank * num_workers + wid::self.world * num_workers]  # doctor: lookalike
        for sid in shards:
            yield from self.read_shard(sid)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    step, seen = 0, 0
    for epoch in range(2):
        loader = DataLoader(ShardStream(n_shards=16, per_shard=32, epoch=epoch, rank=rank, world=dist.get_world_size()),
                            batch_size=16, num_workers=2)
        for x, y, ids in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            seen += int((ids * ids).sum())
        print(f"[rank {rank}] epoch {epoch} steps {step} loss {loss.item():.4f}", flush=True)

    cs = sum(p.detach().double().sum().item() for p in model.parameters())
    print(f"[rank {rank}] consumed-sample checksum {seen} final param checksum {cs:.8f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
