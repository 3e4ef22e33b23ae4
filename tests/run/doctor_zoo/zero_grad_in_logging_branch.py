"""Mistake: `opt.zero_grad()` slipped one indent level into the rank-0 logging block, so it runs
only on rank 0 at every 4th step. Rank 1 never clears its .grad and rank 0 only sometimes: each
backward adds onto the previous gradient, and the ranks feed different (stale, summed) gradients into
DDP's all-reduce. Nothing fails: shapes match, the collectives line up, the loss is still finite."""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def train(rank: int) -> None:
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(512, 24, generator=gen)
    y = x[:, :4].sum(dim=1, keepdim=True) + 0.1 * torch.randn(512, 1, generator=gen)
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)  # 256 samples, 16 batches per rank
    loader = DataLoader(dataset, batch_size=16, sampler=sampler)

    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(24, 48), nn.Tanh(), nn.Linear(48, 1)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.02, momentum=0.9)
    running = 0.0
    step = 0
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            loss = F.mse_loss(ddp(xb), yb)
            loss.backward()
            opt.step()
            step += 1
            running += loss.item()
            if rank == 0 and step % 4 == 0:
                running = 0.0  # would be sent to the logger here
                opt.zero_grad()  # doctor: cause
    last = torch.tensor([loss.item()])
    dist.all_reduce(last)  # last step's loss summed over the ranks, for the run summary


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    train(rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
