"""Healthy DDP: DistributedSampler with set_epoch, 2 epochs, a rank-0-only checkpoint followed by a
barrier that every rank calls, and a final metric all-reduce on every rank. Exits 0 on every rank."""

import argparse
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    gen = torch.Generator().manual_seed(0)  # same dataset on every rank; the sampler splits it
    dataset = TensorDataset(torch.randn(256, 16, generator=gen), torch.randn(256, 1, generator=gen))
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=16, sampler=sampler)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    ckpt_dir = tempfile.mkdtemp(prefix="zoo_ckpt_") if rank == 0 else None

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # zoo: set_epoch
        total, count = 0.0, 0
        for x, y in loader:
            loss = F.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()  # zoo: backward
            opt.step()
            total, count = total + loss.item() * len(x), count + len(x)
        if rank == 0:
            torch.save(model.state_dict(), os.path.join(ckpt_dir, f"epoch{epoch}.pt"))  # zoo: save
        dist.barrier()  # zoo: barrier

    metric = torch.tensor([total, float(count)])
    dist.all_reduce(metric)  # zoo: metric_all_reduce
    if rank == 0:
        print(f"last-epoch mean loss over all ranks: {metric[0].item() / metric[1].item():.4f}", flush=True)
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    dist.destroy_process_group()  # zoo: destroy


if __name__ == "__main__":
    main()
