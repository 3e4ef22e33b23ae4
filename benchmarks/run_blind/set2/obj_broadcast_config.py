"""Config-driven training on 2 ranks: rank 0 assembles the run configuration (model
sizes, learning-rate schedule and a target function for the synthetic regression data)
and broadcasts it to the other rank as a Python object; every rank then generates its
shard from the shared target and trains a DDP-wrapped MLP under the shared schedule."""
import datetime
import math

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def make_config():
    scale = 0.5
    return {
        "hidden": 32,
        "lr": 0.05,
        "epochs": 4,
        "warmup": 3,
        "target": lambda x: torch.sin(x[:, :1] * scale) + x[:, 1:2],
    }


def lr_at(cfg, step):
    return cfg["lr"] * min(1.0, (step + 1) / cfg["warmup"]) * 0.5 * (1 + math.cos(math.pi * step / 40))


def train(rank, world):
    box = [make_config() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    cfg = box[0]
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(160, 4, generator=g)
    y = cfg["target"](x)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(4, cfg["hidden"]), nn.ReLU(), nn.Linear(cfg["hidden"], 1)))
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
    step = 0
    for epoch in range(cfg["epochs"]):
        for i in range(0, 160, 16):
            for group in opt.param_groups:
                group["lr"] = lr_at(cfg, step)
            loss = nn.functional.mse_loss(model(x[i:i + 16]), y[i:i + 16])
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f}", flush=True)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    train(dist.get_rank(), dist.get_world_size())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
