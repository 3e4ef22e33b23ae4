"""What the gradsync trainer costs over a hand-written DDP loop, measured side by side.

Both loops train identical copies of one model on the same data in the same processes, in
alternating blocks of steps so that machine noise hits both alike. Reports the ratio of median
step times (gradsync / plain DDP). Run with `make bench-overhead` or:

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/trainer_overhead.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import gradsync


def make_model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(256, width), torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, 10),
    )


def timed_steps(step_fn, batches, n: int) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        step_fn(next(batches))
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--steps-per-block", type=int, default=20)
    args = parser.parse_args()

    trainer = gradsync.setup(seed=0, metrics={"progress": False, "tensorboard": False})
    g = torch.Generator().manual_seed(0)
    n = args.batch_size * args.steps_per_block * args.blocks * trainer.world_size * 2
    data = TensorDataset(torch.randn(n, 256, generator=g), torch.randint(0, 10, (n,), generator=g))

    plain_model = DistributedDataParallel(make_model(args.width))
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=0.01)
    sampler = DistributedSampler(data, seed=0)
    plain_batches = iter(DataLoader(data, batch_size=args.batch_size, sampler=sampler))

    def plain_step(batch):
        x, y = batch
        F.cross_entropy(plain_model(x), y).backward()
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)

    base = make_model(args.width)
    model, optimizer, loader = trainer.prepare(base, torch.optim.SGD(base.parameters(), lr=0.01), data, batch_size=args.batch_size)
    loader.set_epoch(0)
    gradsync_batches = iter(loader)

    def gradsync_step(batch):
        x, y = batch
        with trainer.step() as step:
            loss = F.cross_entropy(model(x), y)
            step.backward(loss)
        trainer.log(loss=loss)

    plain, ours = [], []
    timed_steps(plain_step, plain_batches, 5)  # warm-up
    timed_steps(gradsync_step, gradsync_batches, 5)
    for _ in range(args.blocks):
        plain += timed_steps(plain_step, plain_batches, args.steps_per_block)
        ours += timed_steps(gradsync_step, gradsync_batches, args.steps_per_block)
    trainer.close()
    if trainer.is_main:
        params = sum(p.numel() for p in base.parameters())
        p_med, o_med = statistics.median(plain), statistics.median(ours)
        print(f"model {params / 1e6:.1f}M parameters, batch {args.batch_size}/rank, world size {trainer.world_size}")
        print(f"median step: plain DDP {1e3 * p_med:.2f} ms | gradsync {1e3 * o_med:.2f} ms | ratio {o_med / p_med:.3f}")


if __name__ == "__main__":
    main()
