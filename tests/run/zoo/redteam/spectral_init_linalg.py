"""Rank 0 computes a spectral-norm init in ONE long native call (~17 s).

Mechanism (a), HEALTHY. Rank 0 calls torch.linalg.eigvalsh on a symmetric
matrix whose size is calibrated at run time so that the single call takes about
17 s on this machine (one thread: torchrun sets OMP_NUM_THREADS=1). The main
thread's Python stack does not change during the call and no other thread or
child process of rank 0 is busy. Rank 1 waits in dist.broadcast meanwhile.
Then both ranks train a little and exit 0.

Drawn from: https://github.com/EleutherAI/bergson/pull/444
("Rank 0 reduces and eigendecomposes the Grams ... while every other rank is
already waiting in the all_reduce. That is not a deadlock -- rank 0 does
arrive").
"""
import os
import time

import torch
import torch.distributed as dist

TARGET_SECONDS = 17.0


def _sym(n, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n, generator=g, dtype=torch.float64)
    return (a + a.T) / (2.0 * n ** 0.5)


def _timed_eig(n):
    a = _sym(n, 1)
    t = time.perf_counter()
    torch.linalg.eigvalsh(a)
    return time.perf_counter() - t


def pick_size(target):
    n0 = 400
    t0 = max(_timed_eig(n0), 1e-3)
    n1 = int(min(6000, max(n0, n0 * (1.5 / t0) ** (1 / 3))))
    t1 = max(_timed_eig(n1), 1e-3)
    n2 = int(min(10000, max(n1, n1 * (target / t1) ** (1 / 3))))
    print(f"[spectral] n0={n0}:{t0:.2f}s n1={n1}:{t1:.2f}s -> n={n2}", flush=True)
    return n2


def spectral_scale():
    n = pick_size(TARGET_SECONDS)
    big = _sym(n, 2)
    t = time.perf_counter()
    evals = torch.linalg.eigvalsh(big)  # zoo: native-call
    print(f"[spectral] eigvalsh n={n} took {time.perf_counter() - t:.1f}s", flush=True)
    return evals.abs().max().to(torch.float32)


def main():
    dist.init_process_group(backend="gloo")
    rank = int(os.environ["RANK"])
    scale = torch.zeros(())
    if rank == 0:
        scale = spectral_scale().reshape(())
    dist.broadcast(scale, src=0)  # zoo: peer-wait

    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 16)
    with torch.no_grad():
        layer.weight.mul_(1.0 / float(scale))
    opt = torch.optim.SGD(layer.parameters(), lr=0.01)
    for _ in range(10):
        x = torch.randn(8, 16)
        loss = (layer(x) - x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        for p in layer.parameters():
            dist.all_reduce(p.grad)  # Gloo has no ReduceOp.AVG
            p.grad /= dist.get_world_size()
        opt.step()
    print(f"rank {rank}: scale={float(scale):.3f} loss={loss.item():.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
