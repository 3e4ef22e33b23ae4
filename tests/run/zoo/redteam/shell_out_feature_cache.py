"""Rank 0 shells out to a CPU-heavy child process to build a feature cache.

Mechanism (a), HEALTHY: while rank 0's main thread sits in subprocess.run()
waiting for its child (a `python -c` job that burns one core for ~22 s),
rank 1 is already blocked in an all_reduce. The child finishes, rank 0 joins
the all_reduce and both ranks train a few steps and exit 0.

Drawn from: https://github.com/pytorch/pytorch/issues/62381
("torch.distributed and subprocess do not work together?": a rank runs a
subprocess between init_process_group and its first collective; the maintainer
shows the pattern itself is fine once the process group is set up correctly).
"""
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

CHILD = r"""
import hashlib, time
deadline = time.monotonic() + 22.0
digest = b"seed"
rounds = 0
while time.monotonic() < deadline:
    for _ in range(4000):
        digest = hashlib.sha256(digest).digest()
    rounds += 1
print(rounds, digest.hex()[:12])
"""


def build_feature_cache():
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)  # zoo: child-wait
    rounds, tag = proc.stdout.split()
    print(f"[rank 0] feature cache built in {time.time() - t0:.1f}s ({rounds} rounds, {tag})", flush=True)
    return int(rounds)


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])

    n_feat = torch.zeros(1)
    if rank == 0:
        n_feat += build_feature_cache() % 97 + 16
    dist.all_reduce(n_feat)  # zoo: peer-wait
    width = int(n_feat.item())

    torch.manual_seed(0)
    w = torch.zeros(width, 1, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.05)
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(20):
        x = torch.randn(32, width, generator=g)
        y = x[:, :1] * 0.5
        loss = ((x @ w - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        dist.all_reduce(w.grad)
        w.grad /= world
        opt.step()
    print(f"[rank {rank}] width={width} final loss {loss.item():.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
