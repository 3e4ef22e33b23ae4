"""Preemption-tolerant training: the job runs in segments and resumes from the last checkpoint."""
import argparse
import math
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


def make_dataset(n=1024, dim=32, classes=5, seed=23):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, classes, generator=g)
    return TensorDataset(x, (x @ w + 0.5 * torch.randn(n, classes, generator=g)).argmax(dim=1))


class Net(nn.Module):
    def __init__(self, dim=32, hidden=128, classes=5):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                                 nn.Linear(hidden, classes))

    def forward(self, x):
        return self.net(x)


def warmup_cosine(warmup, total):
    def fn(step):
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return fn


def run_segment(args, rank, world_size, ckpt_path, stop_at):
    torch.manual_seed(0)
    model = DDP(Net())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.warmup, args.total_steps))

    step = 0
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        step = ckpt["step"]
        if rank == 0:
            print(f"resumed from step {step}", flush=True)

    dataset = make_dataset()
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    steps_per_epoch = len(loader)

    while step < stop_at:
        sampler.set_epoch(step // steps_per_epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            if rank == 0 and step % 8 == 0:
                print(f"step {step} loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.2e}", flush=True)
            if step >= stop_at:
                break

    if rank == 0:
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, ckpt_path)
    dist.barrier()
    del model, optimizer


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--total-steps", type=int, default=64)
    parser.add_argument("--segment-steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])

    workdir = [tempfile.mkdtemp(prefix="resume_") if rank == 0 else None]
    dist.broadcast_object_list(workdir, src=0)
    ckpt_path = os.path.join(workdir[0], "last.pt")

    # simulate the job being preempted every `segment_steps` steps and restarted from the checkpoint
    done = 0
    while done < args.total_steps:
        stop_at = min(done + args.segment_steps, args.total_steps)
        run_segment(args, rank, world_size, ckpt_path, stop_at)
        done = stop_at

    dist.barrier()
    if rank == 0:
        shutil.rmtree(workdir[0], ignore_errors=True)
    dist.destroy_process_group()
    time.sleep(0.5)  # let gloo's background threads wind down before the interpreter exits


if __name__ == "__main__":
    main()
