"""Mistake: the sampler's `num_replicas` comes from a config written for a 4-process job
(`config["gpus"] == 4`) while the job runs 2 ranks. Rank 0 and rank 1 take shares 0 and 1 of four;
shares 2 and 3, half the dataset, are never drawn. Each epoch is just shorter, so nothing complains."""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

CONFIG = {"gpus": 4, "batch_size": 8, "epochs": 2, "lr": 3e-3, "hidden": 48}


def train(config: dict) -> None:
    gen = torch.Generator().manual_seed(141)
    x = torch.randn(512, 12, generator=gen)
    y = (x[:, :6].sum(dim=1) > 0).long()
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, num_replicas=config["gpus"], rank=dist.get_rank())  # doctor: cause
    loader = DataLoader(dataset, batch_size=config["batch_size"], sampler=sampler)

    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(12, config["hidden"]), nn.ReLU(), nn.Linear(config["hidden"], 2)))
    opt = torch.optim.AdamW(ddp.parameters(), lr=config["lr"])
    for epoch in range(config["epochs"]):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            loss = F.cross_entropy(ddp(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
    last = torch.tensor([loss.item()])
    dist.all_reduce(last)  # last step's loss summed over the ranks, for the run summary


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    train(CONFIG)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
