"""Healthy use of object collectives, a subgroup and point-to-point messages (all_gather_object,
broadcast_object_list, new_group([0, 1]) with an all_reduce, rank 0 -> rank 1 send/recv) around a
small DDP training loop. Needs at least 2 processes; exits 0 on every rank."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world < 2:
        raise SystemExit("healthy_objects.py needs at least 2 processes")

    # Every rank reports itself; every rank receives rank 0's run settings.
    reports = [None] * world
    dist.all_gather_object(reports, {"rank": rank, "pid": os.getpid()})  # zoo: all_gather_object
    settings = [{"lr": 0.05, "steps": args.steps}] if rank == 0 else [None]
    dist.broadcast_object_list(settings, src=0)  # zoo: broadcast_object_list
    lr, steps = settings[0]["lr"], settings[0]["steps"]

    # A subgroup of ranks 0 and 1 (every rank must call new_group; only members use it).
    pair = dist.new_group([0, 1])  # zoo: new_group
    if rank in (0, 1):
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t, group=pair)  # zoo: group_all_reduce
        assert t.tolist() == [3.0, 3.0, 3.0], t

    # Point-to-point: rank 0 sends, rank 1 receives (rank-asymmetric by design).
    if rank == 0:
        dist.send(torch.arange(4, dtype=torch.float32), dst=1)  # zoo: send
    elif rank == 1:
        buf = torch.empty(4)
        dist.recv(buf, src=0)  # zoo: recv
        assert buf.tolist() == [0.0, 1.0, 2.0, 3.0], buf

    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(1000 + rank)
    for step in range(1, steps + 1):  # steps counted from 1
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()  # zoo: backward
        opt.step()

    losses = [None] * world
    dist.all_gather_object(losses, round(loss.item(), 4))  # zoo: final_all_gather_object
    if rank == 0:
        print(f"ranks {[r['rank'] for r in reports]} final losses {losses}", flush=True)
    dist.destroy_process_group()  # zoo: destroy


if __name__ == "__main__":
    main()
