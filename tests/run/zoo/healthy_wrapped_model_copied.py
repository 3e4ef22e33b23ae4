"""Healthy: copies of a model once DDP wrapped it, as scripts take them: a snapshot of the wrapper
(`copy.deepcopy(ddp)`) and an EMA teacher copied from `ddp.module` before the first step, the
wrapper pickled (`pickle.dumps`) with a comm hook of the script's own registered and
`find_unused_parameters=True`, and a walk of every module's attributes and hooks. Each copy holds
only what torch and the script put there; prints their sizes and the losses. Exits 0."""

import argparse
import copy
import os
import pickle

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP


def train(rank: int, steps: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    ddp = DDP(model, find_unused_parameters=True)
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    snapshot = copy.deepcopy(ddp)  # zoo: snapshot
    teacher = copy.deepcopy(ddp.module).requires_grad_(False)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    for step in range(1, steps + 1):
        x, y = torch.randn(16, 16, generator=gen), torch.randn(16, 1, generator=gen)
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()  # zoo: backward
        opt.step()
        with torch.no_grad():
            for t, s in zip(teacher.parameters(), ddp.module.parameters()):
                t.mul_(0.9).add_(s, alpha=0.1)
        print(f"rank {rank} step {step}: loss {loss.item():.6f}")
    pickled = pickle.dumps(ddp)  # zoo: pickle
    walked = [(name, sorted(vars(module)), len(module._forward_pre_hooks), len(module._forward_hooks))
              for name, module in ddp.named_modules()]
    print(f"rank {rank}: pickled {len(pickled)} bytes, snapshot {len(pickle.dumps(snapshot))} bytes, walk {walked}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    # The model lives in train(): its last reference to the group goes before the group is destroyed
    # (../shared/README.md: Gloo's teardown abort otherwise).
    train(int(os.environ["RANK"]), args.steps)
    dist.barrier()  # zoo: final_barrier
    dist.destroy_process_group()  # zoo: destroy


if __name__ == "__main__":
    main()
