"""ZCA-whitening statistics computed by rank 1 with one numpy SVD (~15 s).

Mechanism (a), HEALTHY. Written top-level, script style. Rank 1 spends ~15 s
inside a single numpy.linalg.svd call (size calibrated at run time; numpy's
BLAS is single-threaded under torchrun's OMP_NUM_THREADS=1) while rank 0 waits
in all_gather. Then both train a linear probe and exit 0.

Drawn from: https://github.com/EleutherAI/bergson/pull/444 (asymmetric
rank-local linear algebra while the others wait in a collective; "not a
deadlock") and https://github.com/pytorch/pytorch/issues/87995 (one rank
"stuck" while "all other ranks wait for rank0" in all_reduce).
"""
import os
import time

import numpy as np
import torch
import torch.distributed as dist

TARGET = 15.0
RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
rng = np.random.default_rng(RANK)


def svd_seconds(n):
    m = rng.standard_normal((n, n))
    t = time.perf_counter()
    np.linalg.svd(m, compute_uv=False)
    return time.perf_counter() - t


dist.init_process_group("gloo")

summary = torch.ones(8)
if RANK == 1:
    n = 300
    t = max(svd_seconds(n), 1e-3)
    n = int(min(5000, max(300, n * (1.2 / t) ** (1 / 3))))
    t = max(svd_seconds(n), 1e-3)
    n = int(min(9000, max(n, n * (TARGET / t) ** (1 / 3))))
    feats = rng.standard_normal((n, n))
    t0 = time.perf_counter()
    sv = np.linalg.svd(feats, compute_uv=False)  # zoo: native-svd
    print(f"rank 1: svd n={n} in {time.perf_counter() - t0:.1f}s", flush=True)
    summary = torch.from_numpy(sv[:8].copy()).float() / float(sv[0])

gathered = [torch.empty(8) for _ in range(WORLD)]
dist.all_gather(gathered, summary)  # zoo: peer-wait
whiten = torch.stack(gathered).mean(0)

probe = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(probe.parameters(), lr=0.05)
for _ in range(15):
    x = torch.randn(16, 8) * whiten
    loss = (probe(x).squeeze(1) - x.sum(1)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    for p in probe.parameters():
        dist.all_reduce(p.grad)
        p.grad.div_(WORLD)
    opt.step()
print(f"rank {RANK}: probe loss {loss.item():.4f}", flush=True)
dist.barrier()
dist.destroy_process_group()
