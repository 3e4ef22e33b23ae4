"""DDP training that checkpoints every epoch from the main process and makes
sure the file is fully on disk before training goes on."""
import datetime
import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def save_checkpoint(model, opt, epoch, path):
    state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch}
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def train(rank, ckpt_dir):
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(100 + rank)
    for epoch in range(3):
        for _ in range(8):
            x = torch.randn(32, 10, generator=g)
            loss = (model(x).squeeze(1) - x.sum(1)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        if rank == 0:
            save_checkpoint(model, opt, epoch, os.path.join(ckpt_dir, "last.pt"))
            print(f"epoch {epoch} loss {loss.item():.4f}", flush=True)
        dist.barrier()
    state = torch.load(os.path.join(ckpt_dir, "last.pt"))
    model.module.load_state_dict(state["model"])
    print(f"rank {rank} reloaded epoch {state['epoch']}", flush=True)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    rank = dist.get_rank()
    holder = [tempfile.mkdtemp(prefix="ddp_ckpt_") if rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    train(rank, holder[0])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
