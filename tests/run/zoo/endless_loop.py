"""Rank 1's line search never converges: its loss is NaN (a constant feature column standardised by
0/0), and `abs(prev - cur) < tol` is never true for NaN, so it spins in a pure-Python loop at 100%
of a core, its stack changing all the time, while rank 0 waits in dist.all_reduce() for the step
size. Plain torchrun hangs (until Gloo's 30-minute timeout)."""

import os

import torch
import torch.distributed as dist


def standardize(x: torch.Tensor) -> torch.Tensor:
    return (x - x.mean(0)) / x.std(0)


def trial_loss(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, step: float) -> float:
    return ((x @ (w - step * w) - y) ** 2).mean().item()


def line_search(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, tol: float = 1e-7) -> float:
    step, prev, converged = 1.0, float("inf"), False
    while not converged:  # zoo: loop
        cur = trial_loss(w, x, y, step)
        converged = abs(prev - cur) < tol
        prev, step = cur, step * 0.5
    return step


def main() -> None:
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(rank)
    x, w = torch.randn(64, 4, generator=gen), torch.randn(4, 1, generator=gen)
    if rank == 1:
        x[:, 2] = 1.5  # a sensor stuck at a constant: 0/0 when standardised
    x = standardize(x)
    y = x[:, :1]
    step = torch.tensor([line_search(w, x, y)])
    dist.all_reduce(step, op=dist.ReduceOp.MIN)  # zoo: peer_wait
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
