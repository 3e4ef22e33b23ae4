"""A `while not converged:` line search that never converges on rank 1.

Mechanism (b), BROKEN (hangs forever). Rank 1's shard has a constant feature
column; standardising it divides 0 by 0, the probe loss is NaN, and
`abs(prev - cur) < tol` is never true for NaN. Rank 1 spins in a pure-Python
loop (one core at 100 %, the Python stack moving between the loop and the
helper every iteration) while rank 0 waits in all_reduce(MIN) for the agreed
step size.

Drawn from: https://github.com/underworldcode/underworld3/pull/630 ("ranks
[0, 2, 3] stopped at ... rank [1] stopped at ... ranks [1] are where the bug
is") and https://github.com/ptycho/ptypy/issues/108 (a rank "hangs with 100%
CPU usage", no further output).
"""
import os

import torch
import torch.distributed as dist


def load_shard(rank):
    g = torch.Generator().manual_seed(11 + rank)
    x = torch.randn(256, 6, generator=g)
    if rank == 1:
        x[:, 3] = 2.5  # this shard's sensor 3 was stuck at a constant
    y = x[:, :2].sum(1, keepdim=True)
    return x, y


def standardize(x):
    return (x - x.mean(0)) / x.std(0)


def trial_loss(w, x, y, step):
    with torch.enable_grad():
        w = w.detach().requires_grad_(True)
        loss = ((x @ w - y) ** 2).mean()
        (grad,) = torch.autograd.grad(loss, w)
    with torch.no_grad():
        w_new = w - step * grad
        return ((x @ w_new - y) ** 2).mean().item()


def line_search(w, x, y, tol=1e-7):
    step, prev = 1.0, float("inf")
    converged = False
    while not converged:  # zoo: spin
        cur = trial_loss(w, x, y, step)
        converged = abs(prev - cur) < tol
        prev = cur
        step *= 0.5
    return step


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    w = torch.randn(6, 1)
    dist.broadcast(w, src=0)
    x, y = load_shard(rank)
    x = standardize(x)
    for epoch in range(3):
        step = torch.tensor([line_search(w, x, y)])
        dist.all_reduce(step, op=dist.ReduceOp.MIN)  # zoo: peer-wait
        with torch.no_grad():
            grad = 2 * x.T @ (x @ w - y) / len(x)
            dist.all_reduce(grad)
            w -= step.item() * grad / dist.get_world_size()
        print(f"rank {rank} epoch {epoch}: step {step.item():.3g}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
