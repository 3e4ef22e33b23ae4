"""Healthy: a model wrapped in DDP, then compiled (`torch.compile(ddp, backend="eager")`: dynamo
traces the wrapper's forward and DDP's graph splitting at its buckets, without a C compiler), and
trained for a few steps on every rank alike. Under plain torchrun it trains and prints the same
losses every run."""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

STEPS = 10


def train(rank: int) -> None:
    gen = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(512, 16, generator=gen), torch.randn(512, 1, generator=gen))
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=16, sampler=sampler)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))
    ddp = DDP(model)
    compiled = torch.compile(ddp, backend="eager")  # doctor: lookalike
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    step = 0
    for x, y in loader:
        loss = F.mse_loss(compiled(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        print(f"rank {rank} step {step}: loss {loss.item():.6f}")
        if step == STEPS:
            break


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    # The compiled model lives in train(): the last reference to the group must go before the
    # group is destroyed (../shared/README.md: a Gloo teardown abort otherwise).
    train(int(os.environ["RANK"]))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
