import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class MultiTaskNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.cls_head = nn.Linear(64, 4)
        self.reg_head = nn.Linear(64, 1)

    def forward(self, x):
        h = self.trunk(x)
        return self.cls_head(h), self.reg_head(h).squeeze(-1)


def make_data(n=640, seed=8):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 10, generator=g)
    y_cls = (x[:, :4] + 0.2 * torch.randn(n, 4, generator=g)).argmax(1)
    y_reg = 3.0 * x[:, 4] - x[:, 5] ** 2 + 0.5 * torch.randn(n, generator=g)
    return TensorDataset(x, y_cls, y_reg)


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    torch.manual_seed(0)

    data = make_data()
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(data, batch_size=32, sampler=sampler, drop_last=True)

    model = DDP(MultiTaskNet())
    # homoscedastic uncertainty weighting (Kendall et al.), one log-variance per task
    log_vars = torch.zeros(2, requires_grad=True)
    optimizer = torch.optim.Adam(
        [{"params": model.parameters()}, {"params": [log_vars], "lr": 2e-2}],
        lr=2e-3,
    )

    for epoch in range(4):
        sampler.set_epoch(epoch)
        for x, y_cls, y_reg in loader:
            logits, reg = model(x)
            l_cls = F.cross_entropy(logits, y_cls)
            l_reg = F.mse_loss(reg, y_reg)
            loss = (
                torch.exp(-log_vars[0]) * l_cls + log_vars[0]
                + 0.5 * torch.exp(-log_vars[1]) * l_reg + 0.5 * log_vars[1]
            )
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if rank == 0:
            w = torch.exp(-log_vars.detach())
            print(f"epoch {epoch} cls {l_cls.item():.3f} reg {l_reg.item():.3f} "
                  f"task weights {w[0].item():.3f}/{w[1].item():.3f}", flush=True)

    dist.barrier()
    dist.destroy_process_group()
    time.sleep(1)


if __name__ == "__main__":
    main()
