"""Each rank starts a metrics heartbeat thread (not a daemon) that an atexit handler is meant to
stop. CPython joins non-daemon threads before it runs atexit handlers, so the handler never runs
and no rank's process ever exits: plain torchrun hangs after the script's last line."""

import atexit
import os
import threading

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def heartbeat(stop: threading.Event, beats: list[int]) -> None:
    while not stop.wait(0.2):  # zoo: heartbeat_wait
        beats.append(len(beats))


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    stop, beats = threading.Event(), []
    beating = threading.Thread(target=heartbeat, args=(stop, beats), name="heartbeat")  # zoo: thread_create
    beating.start()  # zoo: thread_start
    atexit.register(stop.set)

    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)
    for _ in range(3):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.destroy_process_group()
    print(f"rank {rank}: training done")


if __name__ == "__main__":
    main()
