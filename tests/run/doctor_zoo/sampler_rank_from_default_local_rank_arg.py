"""Mistake: an old torch.distributed.launch-style script reads its rank from `--local_rank`, which
defaults to 0. torchrun passes LOCAL_RANK in the environment, not as this argument, so every process
builds `DistributedSampler(..., rank=args.local_rank)` with rank 0: both ranks train on rank 0's
share and the other half of the data is never seen. The process group itself is fine, so nothing
fails."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.05)
    return parser.parse_args()


def train(args: argparse.Namespace) -> None:
    gen = torch.Generator().manual_seed(131)
    x = torch.randn(512, 20, generator=gen)
    y = (x @ torch.randn(20, 1, generator=gen)).tanh()
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, num_replicas=dist.get_world_size(), rank=args.local_rank)  # doctor: cause
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(20, 40), nn.ReLU(), nn.Linear(40, 1)))
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            loss = F.mse_loss(ddp(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
    last = torch.tensor([loss.item()])
    dist.all_reduce(last)  # last step's loss summed over the ranks, for the run summary


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    train(args)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
