"""BYOL-style training: the target network is a copy of the online network taken after DDP was built
(the same on every rank), and moved toward it by a momentum update after each step. The update sits
under `if rank == 0:` beside the logging, as an EMA kept only for the checkpoint would: but this
target feeds the loss on every rank. Rank 1's target stays at its first weights; the two ranks
regress onto different targets from step 2 on."""

import copy
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = 16
TAU = 0.9


@torch.no_grad()
def momentum_update(target: nn.Module, online: nn.Module) -> None:
    for t, o in zip(target.parameters(), online.parameters()):
        t.lerp_(o, 1 - TAU)


def train(rank: int) -> None:
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)))
    target = copy.deepcopy(model.module).requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    for step in range(1, STEPS + 1):
        x = torch.randn(16, 16, generator=gen)
        online = model(x + 0.1 * torch.randn(16, 16, generator=gen))
        with torch.no_grad():
            z = target(x)
        loss = 2 - 2 * F.cosine_similarity(online, z, dim=-1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0:
            momentum_update(target, model.module)  # doctor: cause
            if step % 8 == 0:
                print(f"step {step} loss {loss.item():.4f}")


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    train(int(os.environ["RANK"]))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
