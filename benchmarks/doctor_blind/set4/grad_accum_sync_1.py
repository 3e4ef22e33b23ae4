import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class MLP(nn.Module):
    def __init__(self, d_in=20, d_hidden=64, n_classes=5):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(d_in, d_hidden),
            nn.ReLU(),
            nn.Linear(d_hidden, d_hidden),
            nn.ReLU(),
            nn.Linear(d_hidden, n_classes),
        )

    def forward(self, x):
        return self.net(x)


def build_dataset(n=1024, d_in=20, n_classes=5, seed=1234):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    w = torch.randn(d_in, n_classes, generator=g)
    y = (x @ w + 0.3 * torch.randn(n, n_classes, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    torch.manual_seed(0)

    accum_steps = 4
    epochs = 4
    dataset = build_dataset()
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(dataset, batch_size=16, sampler=sampler, drop_last=True)

    model = DDP(MLP())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    step = 0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        running = 0.0
        optimizer.zero_grad(set_to_none=True)
        for batch_idx, (x, y) in enumerate(loader):
            sync_ctx = model.no_sync if batch_idx % accum_steps != 0 else nullcontext
            with sync_ctx():
                loss = F.cross_entropy(model(x), y) / accum_steps
                loss.backward()
            running += loss.item()
            if (batch_idx + 1) % accum_steps == 0:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                if rank == 0 and step % 8 == 0:
                    print(f"epoch {epoch} step {step} loss {running:.4f}", flush=True)
                running = 0.0

    if rank == 0:
        print(f"done after {step} optimizer steps", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    time.sleep(1)


if __name__ == "__main__":
    main()
