"""Length-bucketed sequence regression on 2 ranks: each rank takes a strided shard of
variable-length synthetic sequences, groups it into length buckets, computes per-bucket
mean lengths with a small C helper compiled at start-up, pads each length-sorted batch
to the mean length of its buckets and trains a DDP-wrapped GRU regressor for a few epochs."""
import ctypes
import datetime
import os
import subprocess
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

C_SRC = r"""
int mean_len(const int *lens, int n) {
    long s = 0;
    for (int i = 0; i < n; i++) s += lens[i];
    return (int)(s / n);
}
"""
BUCKETS = [(1, 8), (8, 16), (16, 33)]


def load_helper():
    d = tempfile.mkdtemp(prefix="bucket_")
    with open(os.path.join(d, "h.c"), "w") as f:
        f.write(C_SRC)
    so = os.path.join(d, "libh.so")
    subprocess.check_call(["gcc", "-O1", "-shared", "-fPIC", "-o", so, os.path.join(d, "h.c")])
    lib = ctypes.CDLL(so)
    lib.mean_len.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    lib.mean_len.restype = ctypes.c_int
    return lib


def make_corpus(n=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = []
    for i in range(n):
        if i % 2 == 0:
            lens.append(int(torch.randint(1, 33, (1,), generator=g)))
        else:
            lens.append(int(torch.randint(1, 16, (1,), generator=g)))
    return [torch.randn(l, 4, generator=g) for l in lens]


def bucket_of(length):
    for b, (lo, hi) in enumerate(BUCKETS):
        if lo <= length < hi:
            return b
    return len(BUCKETS) - 1


def bucketize(lib, seqs, batch_size=8):
    targets = {}
    for b, (lo, hi) in enumerate(BUCKETS):
        members = [s.shape[0] for s in seqs if lo <= s.shape[0] < hi]
        if not members:
            continue
        arr = (ctypes.c_int * max(len(members), 1))(*members)
        targets[b] = lib.mean_len(arr, len(members))
    order = sorted(seqs, key=lambda s: s.shape[0])
    out = []
    for i in range(0, len(order), batch_size):
        chunk = order[i:i + batch_size]
        target = max(targets[bucket_of(s.shape[0])] for s in chunk)
        batch = torch.zeros(len(chunk), target, 4)
        for j, s in enumerate(chunk):
            k = min(target, s.shape[0])
            batch[j, :k] = s[:k]
        out.append((batch, batch.sum(dim=(1, 2)).unsqueeze(1) * 0.1))
    return out


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(4, 16, batch_first=True)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        _, h = self.rnn(x)
        return self.head(h[-1])


def train(rank, world):
    lib = load_helper()
    corpus = make_corpus()
    shard = corpus[rank::world]
    torch.manual_seed(0)
    model = DDP(Regressor())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(3):
        batches = bucketize(lib, shard)
        for x, y in batches:
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f}", flush=True)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    train(rank, world)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
