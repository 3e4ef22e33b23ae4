"""Fine-tune an MLP with DDP starting from a pretrained checkpoint produced by a short pretraining run."""
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def make_net():
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))


def target_fn(x):
    return torch.sin(x[:, :1]) + 0.5 * x[:, 1:2] * x[:, 2:3]


def pretrain(path):
    torch.manual_seed(77)
    net = make_net()
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    for _ in range(60):
        x = torch.randn(64, 8, generator=g)
        loss = nn.functional.mse_loss(net(x), target_fn(x))
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.save(net.state_dict(), path)


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)

    holder = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    ckpt_path = os.path.join(holder[0], "pretrained.pt")
    if rank == 0:
        pretrain(ckpt_path)
    dist.barrier()

    torch.manual_seed(rank)
    model = make_net()
    if rank == 0:
        model.load_state_dict(torch.load(ckpt_path, map_location="cpu"))
    model = DDP(model)

    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(10 + rank)
    for step in range(30):
        x = torch.randn(32, 8, generator=g)
        y = target_fn(x) + 0.05 * torch.randn(32, 1, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 10 == 0:
            print(f"rank {rank} step {step} loss {loss.item():.4f}")

    dist.barrier()
    if rank == 0:
        shutil.rmtree(holder[0], ignore_errors=True)
    dist.destroy_process_group()
    time.sleep(1)


if __name__ == "__main__":
    main()
