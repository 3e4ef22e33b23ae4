import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

EPOCHS = 2
BATCH_SIZE = 32
SEED = 1234


def make_dataset(n=2048, dim=20, classes=4):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, classes, generator=g)
    y = (x @ w + 0.3 * torch.randn(n, classes, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


class MLP(nn.Module):
    def __init__(self, dim=20, hidden=64, classes=4):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, classes)
        )

    def forward(self, x):
        return self.net(x)


def average_gradients(model, world_size):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad /= world_size


def train(rank, world_size):
    torch.manual_seed(SEED + rank)
    model = MLP()
    for tensor in model.state_dict().values():
        dist.broadcast(tensor, src=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    dataset = make_dataset()
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=SEED)
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler)

    step = 0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x = x + 0.05 * torch.randn_like(x)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            average_gradients(model, world_size)
            optimizer.step()
            step += 1
            if step % 16 == 0:
                print(f"rank {rank} epoch {epoch} step {step} loss {loss.item():.4f}")


def main():
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    train(rank, world_size)
    dist.destroy_process_group()
    time.sleep(0.5)


if __name__ == "__main__":
    main()
