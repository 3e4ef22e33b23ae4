"""Rank 0 registers an atexit hook that all-reduces counters after the peer left.

Mechanism (f): a collective issued by one rank after the others have left.
Rank 0 (the logging rank) registers `flush_counters` with atexit; it
all-reduces the per-rank sample counters "one last time". No other rank
registered it. The script body finishes normally on both ranks; rank 1's
process ends, and rank 0's atexit all_reduce has no partner. Gloo reports the
closed connection, Python prints "Exception ignored in atexit callback" and
the exit status stays 0, so torchrun reports success.

Expected: "warning: collective after peer left, rank 0, line atexit-collective".

Drawn from: https://github.com/Lightning-AI/pytorch-lightning/pull/19931
("Destroy process group in atexit handler": distributed calls moved into
atexit, which runs per process at its own exit) and
https://github.com/pytorch/pytorch/pull/179291 (atexit teardown of process
groups; "requires discussion and it's much more complicated than I
anticipated").
"""
import atexit
import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = int(os.environ["RANK"])
counters = torch.zeros(2, dtype=torch.int64)


def flush_counters():
    dist.all_reduce(counters)  # zoo: atexit-collective
    print(f"[rank {rank}] global samples={int(counters[0])} skipped={int(counters[1])}", flush=True)


if rank == 0:
    atexit.register(flush_counters)

model = torch.nn.Linear(3, 1)
for p in model.parameters():
    dist.broadcast(p.data, 0)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(10):
    x = torch.randn(8 + rank, 3)
    keep = x.abs().max(1).values < 2.5
    counters += torch.tensor([int(keep.sum()), int((~keep).sum())])
    loss = (model(x[keep]) - x[keep].sum(1, keepdim=True)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)  # zoo: last-matched
        p.grad /= 2
    opt.step()
print(f"[rank {rank}] training done", flush=True)
