"""Mistake: multi-task training with uncertainty weighting (Kendall et al.): the criterion is an
nn.Module holding learnable `log_vars`, built beside the DDP model and its parameters added to the
optimizer. Only the model is wrapped in DDP, so the log_vars gradients are never averaged: each rank
steps its own copy with its own local gradient and the task weights drift apart across ranks,
without any error."""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class MultiTaskNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(16, 48), nn.ReLU())
        self.reg_head = nn.Linear(48, 1)
        self.cls_head = nn.Linear(48, 4)

    def forward(self, x: torch.Tensor):
        h = self.trunk(x)
        return self.reg_head(h).squeeze(1), self.cls_head(h)


class UncertaintyWeightedLoss(nn.Module):
    def __init__(self, tasks: int = 2) -> None:
        super().__init__()
        self.log_vars = nn.Parameter(torch.zeros(tasks))  # doctor: cause

    def forward(self, reg_pred, reg_target, cls_logits, cls_target) -> torch.Tensor:
        losses = torch.stack([F.mse_loss(reg_pred, reg_target), F.cross_entropy(cls_logits, cls_target)])
        return (torch.exp(-self.log_vars) * losses + self.log_vars).sum()


def train(rank: int) -> None:
    gen = torch.Generator().manual_seed(111)
    x = torch.randn(512, 16, generator=gen)
    reg = x[:, 0] * 2 + x[:, 1] - x[:, 2] + 0.5 * torch.randn(512, generator=gen)
    cls = (x[:, 3:7] + 0.5 * torch.randn(512, 4, generator=gen)).argmax(dim=1)
    dataset = TensorDataset(x, reg, cls)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)  # 256 samples, 16 batches per rank
    loader = DataLoader(dataset, batch_size=16, sampler=sampler)

    torch.manual_seed(0)
    ddp = DDP(MultiTaskNet())
    criterion = UncertaintyWeightedLoss()
    opt = torch.optim.Adam(list(ddp.parameters()) + list(criterion.parameters()), lr=5e-3)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for xb, rb, cb in loader:
            reg_pred, cls_logits = ddp(xb)
            loss = criterion(reg_pred, rb, cls_logits, cb)
            opt.zero_grad()
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
