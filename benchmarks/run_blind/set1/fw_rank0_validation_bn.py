"""DDP training of a small conv net with BatchNorm. Validation is cheap, so
only the main process runs it at the end of each epoch."""
import datetime

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2),
    )


def validate(model, images, labels):
    model.eval()
    with torch.no_grad():
        acc = (model(images).argmax(1) == labels).float().mean().item()
    model.train()
    return acc


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    rank = dist.get_rank()
    model = DDP(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    val_x = torch.randn(32, 1, 8, 8, generator=g)
    val_y = (val_x.mean((1, 2, 3)) > 0).long()
    for epoch in range(3):
        for _ in range(5):
            x = torch.randn(16, 1, 8, 8, generator=g)
            y = (x.mean((1, 2, 3)) > 0).long()
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f} val acc {validate(model, val_x, val_y):.3f}", flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
