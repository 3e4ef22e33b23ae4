"""Training with a fault-tolerant loss-averaging helper on 2 ranks: a DDP-wrapped MLP
trains on synthetic data, ranks periodically upload a small artefact to slow shared
storage, and the averaged loss that rank 0 logs comes from an all-reduce helper that
waits a bounded time for the collective and re-issues it if it does not complete."""
import datetime
import time

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

WAIT = datetime.timedelta(seconds=2)


def averaged(value, retries=3):
    for attempt in range(retries):
        t = torch.tensor([value])
        work = dist.all_reduce(t, async_op=True)
        try:
            work.wait(timeout=WAIT)
            return t.item() / dist.get_world_size()
        except RuntimeError:
            print(f"[rank {dist.get_rank()}] loss all-reduce attempt {attempt} timed out, retrying", flush=True)
    return value


def upload_artifact(rank, step):
    time.sleep(0.2 if rank == 0 else 3.5)


def train(rank):
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    for step in range(30):
        x = torch.randn(32, 10, generator=g)
        loss = nn.functional.mse_loss(model(x), x[:, :2].sum(dim=1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 10:
            upload_artifact(rank, step)
        avg = averaged(loss.item())
        if rank == 0 and step % 10 == 0:
            print(f"step {step} avg loss {avg:.4f}", flush=True)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    train(dist.get_rank())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
