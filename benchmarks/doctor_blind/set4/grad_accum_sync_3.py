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
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=17)
    loader = DataLoader(dataset, batch_size=16, sampler=sampler, drop_last=True)

    net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5))
    model = DDP(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    step = 0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        optimizer.zero_grad(set_to_none=True)
        window_loss = 0.0
        for batch_idx, (x, y) in enumerate(loader):
            boundary = (batch_idx + 1) % accum_steps == 0
            ctx = contextlib.nullcontext() if boundary else model.no_sync()
            with ctx:
                loss = F.cross_entropy(model(x), y) / accum_steps
                loss.backward()
            window_loss += loss.item()
            if boundary:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                if rank == 0 and step % 8 == 0:
                    print(f"epoch {epoch} step {step} loss {window_loss:.4f}", flush=True)
                window_loss = 0.0

    if rank == 0:
        print(f"done after {step} optimizer steps", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    time.sleep(1)


if __name__ == "__main__":
    main()
