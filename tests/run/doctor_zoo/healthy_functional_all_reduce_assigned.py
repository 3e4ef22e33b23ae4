"""A mixture-of-experts layer with a load-balancing loss over the global batch, healthy: the counts
summed across ranks by torch.distributed.nn.all_reduce are its return value, and are used."""

import os

import torch
import torch.distributed as dist
import torch.distributed.nn as dist_nn
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = 16
EXPERTS = 4


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(16, EXPERTS)
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = self.router(x).softmax(dim=-1)
        top = probs.argmax(dim=-1)
        out = sum(probs[:, e:e + 1] * expert(x) for e, expert in enumerate(self.experts))  # a soft mixture: every expert trains
        counts = torch.bincount(top, minlength=EXPERTS).float()
        counts = dist_nn.all_reduce(counts)  # doctor: lookalike
        balance = EXPERTS * (counts / counts.sum() * probs.mean(dim=0)).sum()
        return out, balance


def train(rank: int) -> None:
    torch.manual_seed(0)
    model = DDP(MoE())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    for step in range(1, STEPS + 1):
        x = torch.randn(16, 16, generator=gen)
        out, balance = model(x)
        loss = F.mse_loss(out, x) + 0.01 * balance
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    train(int(os.environ["RANK"]))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
