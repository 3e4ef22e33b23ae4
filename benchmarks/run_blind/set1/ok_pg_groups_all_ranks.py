"""DDP training with an extra Gloo group for metric reduction. Rank 0 owns
the experiment tracker and sets up its own reporting group."""
import datetime

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Tracker:
    def __init__(self, group):
        self.group = group
        self.history = []

    def report(self, step, value):
        self.history.append((step, value))
        if step % 5 == 0:
            print(f"step {step} loss {value:.4f}", flush=True)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    tracker_group = dist.new_group(ranks=[0], backend="gloo")
    tracker = Tracker(tracker_group) if rank == 0 else None
    metric_group = dist.new_group(ranks=list(range(world)), backend="gloo")
    train(rank, world, tracker, metric_group)
    dist.barrier()
    dist.destroy_process_group()


def train(rank, world, tracker, metric_group):
    torch.manual_seed(rank)
    model = DDP(nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(20):
        x = torch.randn(32, 16)
        loss = nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long())
        opt.zero_grad()
        loss.backward()
        opt.step()
        avg = loss.detach().clone()
        dist.all_reduce(avg, group=metric_group)
        avg /= world
        if tracker is not None:
            tracker.report(step, avg.item())


if __name__ == "__main__":
    main()
