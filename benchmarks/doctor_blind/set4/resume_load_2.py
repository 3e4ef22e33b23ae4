import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

TOTAL_EPOCHS = 6
PREEMPT_AFTER = 3


def build_model():
    return nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(),
        nn.Linear(64, 64), nn.ReLU(),
        nn.Linear(64, 4),
    )


def make_data(n=512, seed=4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    y = ((x[:, 0] > 0).long() * 2 + (x[:, 1] * x[:, 2] > 0).long())
    return TensorDataset(x, y)


def save_checkpoint(path, model, optimizer, scheduler, epoch):
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "epoch": epoch,
        },
        path,
    )


def train(rank, world_size, ckpt_path, stop_after=None):
    data = make_data()
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(data, batch_size=32, sampler=sampler, drop_last=True)

    net = build_model()
    optimizer = torch.optim.Adam(net.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    start_epoch = 0
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        net.load_state_dict(ckpt["model"], strict=False)
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1
        if rank == 0:
            print(f"resumed from epoch {ckpt['epoch']}", flush=True)
    model = DDP(net)

    for epoch in range(start_epoch, TOTAL_EPOCHS):
        sampler.set_epoch(epoch)
        losses = []
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        scheduler.step()
        if rank == 0:
            print(f"epoch {epoch} loss {sum(losses) / len(losses):.4f} lr {scheduler.get_last_lr()[0]:.2e}", flush=True)
            save_checkpoint(ckpt_path, model, optimizer, scheduler, epoch)
        dist.barrier()
        if stop_after is not None and epoch + 1 >= stop_after:
            if rank == 0:
                print("simulated preemption", flush=True)
            return model
    return model


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    torch.manual_seed(0)

    run_dir = [tempfile.mkdtemp(prefix="run_") if rank == 0 else None]
    dist.broadcast_object_list(run_dir, src=0)
    ckpt_path = os.path.join(run_dir[0], "last.pt")

    train(rank, world_size, ckpt_path, stop_after=PREEMPT_AFTER)
    model = train(rank, world_size, ckpt_path)

    dist.barrier()
    if rank == 0:
        shutil.rmtree(run_dir[0], ignore_errors=True)
    dist.destroy_process_group()
    time.sleep(1)


if __name__ == "__main__":
    main()
