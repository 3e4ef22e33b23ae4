"""Healthy: a learning-rate warmup by tokens seen, set with `group["lr"] = ...` on every rank, where
the count is the job's: each step's non-padding tokens are all-reduced before they are added, so
every rank computes the same learning rate."""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

PEAK_LR, WARMUP_TOKENS, STEPS = 0.05, 4000, 16


def train(rank: int) -> None:
    gen = torch.Generator().manual_seed(rank)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Embedding(50, 16), nn.Flatten(), nn.Linear(16 * 12, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    tokens_seen = 0
    for step in range(1, STEPS + 1):
        tokens = torch.randint(1, 50, (8, 12), generator=gen)
        lengths = torch.randint(4, 13, (8,), generator=gen)
        tokens[torch.arange(12) >= lengths[:, None]] = 0  # padding
        count = (tokens != 0).sum().reshape(1)
        dist.all_reduce(count)
        tokens_seen += int(count)
        for group in optimizer.param_groups:
            group["lr"] = PEAK_LR * min(1.0, tokens_seen / WARMUP_TOKENS)  # doctor: lookalike
        loss = F.mse_loss(model(tokens), lengths[:, None].float())
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
