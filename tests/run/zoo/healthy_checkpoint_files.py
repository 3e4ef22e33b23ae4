"""Healthy DDP that writes files into the folder given as `--out`: rank 0 appends each step's
loss (averaged over the ranks) to `metrics.csv` and saves a checkpoint with `torch.save` after
each epoch; every rank writes `rank<R>.done` at the end. Training is deterministic, so the
files are the same under `gradsync run` as under plain torchrun. Exits 0 on every rank."""

import argparse
import csv
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)
    metrics = open(os.path.join(args.out, "metrics.csv"), "w", newline="") if rank == 0 else None
    writer = csv.writer(metrics) if metrics else None
    if writer:
        writer.writerow(["epoch", "step", "loss"])
    for epoch in range(args.epochs):
        for step in range(1, args.steps + 1):  # steps counted from 1
            x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)
            loss = F.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()  # zoo: backward
            opt.step()
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)  # zoo: loss_all_reduce
            if writer:
                writer.writerow([epoch, step, f"{mean_loss.item() / world:.6f}"])  # zoo: write_metrics
        if rank == 0:
            state = {"epoch": epoch, "model": model.state_dict(), "optimizer": opt.state_dict()}
            torch.save(state, os.path.join(args.out, f"checkpoint-epoch{epoch}.pt"))  # zoo: save
        dist.barrier()  # zoo: barrier
    if metrics:
        metrics.close()
        print(f"wrote {args.epochs} checkpoints and {args.epochs * args.steps} metric rows", flush=True)
    with open(os.path.join(args.out, f"rank{rank}.done"), "w") as f:
        f.write(f"rank {rank} of {world} finished\n")
    dist.barrier()  # zoo: final_barrier
    dist.destroy_process_group()  # zoo: destroy


if __name__ == "__main__":
    main()
