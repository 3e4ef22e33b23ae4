"""Hand-rolled torchmetrics-style validation on 2 ranks: a DDP-wrapped binary classifier
is trained on synthetic data, then a small Metric class accumulates per-rank sums of the
positive-class scores and positive counts over each rank's validation shard, syncs its
states across ranks with all-reduce in compute(), and rank 0 prints the mean score."""
import datetime

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


class MeanPositiveScore:
    def __init__(self):
        self.score_sum = torch.tensor(0.0)
        self.count = torch.tensor(0)

    def update(self, scores, target):
        pos = target == 1
        if pos.any():
            self.score_sum = self.score_sum + scores[pos].sum()
            self.count = self.count + pos.sum()

    def compute(self):
        for state in (self.score_sum, self.count):
            dist.all_reduce(state)
        return (self.score_sum / self.count.clamp(min=1)).item()


def data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return x, (x[:, 0] + 0.3 * x[:, 1] > 0).long()


def validation_shard(rank, world):
    x, y = data(64, 9)
    order = torch.argsort(y, stable=True)
    x, y = x[order], y[order]
    per = len(x) // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def run(rank, world):
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = data(256, rank)
    for epoch in range(3):
        for i in range(0, 256, 32):
            loss = nn.functional.cross_entropy(model(x[i:i + 32]), y[i:i + 32])
            opt.zero_grad()
            loss.backward()
            opt.step()
    metric = MeanPositiveScore()
    vx, vy = validation_shard(rank, world)
    with torch.no_grad():
        for i in range(0, len(vx), 8):
            scores = model.module(vx[i:i + 8]).softmax(dim=-1)[:, 1]
            metric.update(scores, vy[i:i + 8])
    value = metric.compute()
    if rank == 0:
        print(f"mean positive score {value:.4f}", flush=True)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    run(dist.get_rank(), dist.get_world_size())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
