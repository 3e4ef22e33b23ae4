"""Two-level statistics aggregation on 2 ranks: besides the default group the job builds
a 'leaders' group of node-leader ranks (rank 0 on this single node), each rank computes
feature statistics of its data shard, the leaders combine node totals asynchronously
while the shard is being normalised, and a DDP-wrapped linear model is then trained."""
import datetime

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def shard(rank, n=200):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(n, 8, generator=g) * (1 + rank) + rank
    y = (x[:, 0] - x[:, 1]).unsqueeze(1)
    return x, y


def node_totals(x, leaders):
    stats = torch.cat([x.sum(0), (x * x).sum(0), torch.tensor([float(len(x))])])
    dist.all_reduce(stats)
    work = None
    if dist.get_rank() in dist.get_process_group_ranks(leaders):
        work = dist.all_reduce(stats.clone(), group=leaders, async_op=True)
    return stats, work


def train(rank):
    leaders = dist.new_group([0], timeout=datetime.timedelta(seconds=60))
    x, y = shard(rank)
    stats, work = node_totals(x, leaders)
    n = stats[-1]
    mean = stats[:8] / n
    std = (stats[8:16] / n - mean * mean).sqrt()
    xn = (x - mean) / std
    if work is not None:
        work.wait()
    torch.manual_seed(0)
    model = DDP(nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(5):
        for i in range(0, len(xn), 20):
            loss = nn.functional.mse_loss(model(xn[i:i + 20]), y[i:i + 20])
            opt.zero_grad()
            loss.backward()
            opt.step()
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f}", flush=True)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    train(dist.get_rank())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
