"""A `@safe_main` decorator logs an ArithmeticError and returns 0 ("numerical trouble on one worker
must not fail the job"). At step 5, rank 1's loss is non-finite (an inf in its batch): its loss check
raises FloatingPointError before backward, the decorator swallows it and rank 1 exits 0. Rank 0 is
already in step 5's backward, in DDP's gradient all-reduce, which fails once rank 1's process is
gone ("Connection closed by peer"): that RuntimeError is not an ArithmeticError, so rank 0 exits 1,
and torchrun blames rank 0.

Adapted from the red team's ddp_safe_main_swallows.py, whose decorator swallows every Exception:
there the waiting ranks' "Connection closed by peer" is swallowed too and every rank exits 0."""

import functools
import logging
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

logging.basicConfig(level=logging.INFO, format=f"%(levelname)s rank{os.environ.get('RANK')} %(message)s")
log = logging.getLogger("train")


def safe_main(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ArithmeticError:
            log.exception("numerical failure; exiting cleanly so the job is not marked failed")
            return 0  # zoo: early_return
    return wrapper


def checked(loss: torch.Tensor) -> torch.Tensor:
    if not torch.isfinite(loss):
        raise FloatingPointError(f"non-finite loss {loss.item()}")
    return loss


@safe_main
def main() -> int:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    torch.manual_seed(5)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    for step in range(1, 11):  # steps counted from 1
        x = torch.randn(12, 8, generator=gen)
        if rank == 1 and step == 5:
            x[3, 1] = float("inf")
        loss = checked(model(x).pow(2).mean())  # zoo: check
        opt.zero_grad()
        loss.backward()  # zoo: backward
        opt.step()
        log.info("step %d loss %.4f", step, loss.item())
    return 0


if __name__ == "__main__":
    dist.init_process_group("gloo")
    raise SystemExit(main())
