"""Mistake: a per-rank "corrupted batch" check (a feature beyond 8 sigma in this rank's own batch)
guards only `opt.zero_grad()`, meant to "keep the last good gradient". Forward, backward and step still
run everywhere, so on the steps where rank 1's batch holds an outlier its new gradient is added onto
the old one while rank 0 starts fresh. The collectives still line up, so nothing errors."""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def make_dataset() -> TensorDataset:
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(384, 16, generator=gen)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    # a few corrupted rows; with an unshuffled sampler the odd indices go to rank 1
    for i in (33, 131, 229, 327):
        x[i, 5] = 40.0
    return TensorDataset(x, y)


def train(rank: int) -> None:
    dataset = make_dataset()
    sampler = DistributedSampler(dataset, shuffle=False)  # 192 samples, 16 batches per rank
    loader = DataLoader(dataset, batch_size=12, sampler=sampler)

    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 3)))
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    for epoch in range(2):
        for x, y in loader:
            bad_batch = bool((x.abs() > 8).any())
            if not bad_batch:  # on a corrupted batch, keep the last good gradient
                opt.zero_grad()  # doctor: cause
            logits = ddp(x.clamp(-8, 8))
            loss = F.cross_entropy(logits, y)
            loss.backward()
            opt.step()
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
