import contextlib
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

MICRO_BATCH = 8
ACCUM_STEPS = 4
EPOCHS = 1


def make_dataset(n=2176, dim=20, classes=5):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, classes, generator=g)
    y = (x @ w + 0.2 * torch.randn(n, classes, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


class Net(nn.Module):
    def __init__(self, dim=20, hidden=64, classes=5):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def train(rank, world_size):
    torch.manual_seed(0)
    model = DDP(Net())
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)

    dataset = make_dataset()
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=MICRO_BATCH, sampler=sampler)

    opt_steps = 0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            is_update_step = (i + 1) % ACCUM_STEPS == 0
            ctx = model.no_sync() if i % ACCUM_STEPS != 0 else contextlib.nullcontext()
            with ctx:
                loss = F.cross_entropy(model(x), y) / ACCUM_STEPS
                loss.backward()
            if is_update_step:
                optimizer.step()
                optimizer.zero_grad()
                opt_steps += 1
                if rank == 0 and opt_steps % 8 == 0:
                    print(f"opt step {opt_steps} loss {loss.item() * ACCUM_STEPS:.4f}")


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
