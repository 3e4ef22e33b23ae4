"""Resumable DDP job. Rank 0 stages the latest checkpoint into the local run
directory; whoever finds a checkpoint there resumes from it and the weights
are shared from rank 0."""
import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def stage_checkpoint(run_dir):
    time.sleep(1.0)  # copy from the shared store
    torch.manual_seed(7)
    state = {"model": nn.Linear(4, 4).state_dict(), "epoch": 3}
    torch.save(state, os.path.join(run_dir, "resume.pt"))


def maybe_resume(model, run_dir, rank):
    path = os.path.join(run_dir, "resume.pt")
    start_epoch = 0
    if os.path.exists(path):
        payload = [torch.load(path) if rank == 0 else None]
        dist.broadcast_object_list(payload, src=0)
        model.load_state_dict(payload[0]["model"])
        start_epoch = payload[0]["epoch"] + 1
    return start_epoch


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    rank = dist.get_rank()
    run_dir = f"/tmp/resume_demo_{os.getppid()}"
    os.makedirs(run_dir, exist_ok=True)
    if rank == 0:
        stage_checkpoint(run_dir)
    model = nn.Linear(4, 4)
    start_epoch = maybe_resume(model, run_dir, rank)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for epoch in range(start_epoch, 6):
        x = torch.randn(8, 4)
        loss = (ddp(x) - x.flip(1)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"rank {rank} epoch {epoch} loss {loss.item():.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
