"""1-D signal denoiser (MLP) trained with DDP; batches come from a shuffled DataLoader."""
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

SEED = 1234


def make_dataset(n=640, dim=24):
    g = torch.Generator().manual_seed(7)
    clean = torch.sin(torch.linspace(0, 6.28, dim)).repeat(n, 1) * torch.rand(n, 1, generator=g)
    noisy = clean + 0.2 * torch.randn(n, dim, generator=g)
    return TensorDataset(noisy, clean)


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    torch.manual_seed(SEED)

    dataset = make_dataset()
    loader = DataLoader(dataset, batch_size=32, shuffle=True, drop_last=True)

    model = DDP(nn.Sequential(nn.Linear(24, 48), nn.GELU(), nn.Linear(48, 24)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    loss_fn = nn.MSELoss()

    step = 0
    for epoch in range(2):
        for noisy, clean in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(noisy), clean)
            loss.backward()
            optimizer.step()
            step += 1
        if rank == 0:
            print(f"epoch {epoch} step {step} loss {loss.item():.5f} world_size {world_size}")

    dist.barrier()
    dist.destroy_process_group()
    time.sleep(1)


if __name__ == "__main__":
    main()
