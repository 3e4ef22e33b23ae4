"""Pre-emptible training on 2 ranks: a DDP-wrapped MLP trains on synthetic data; a
SIGUSR1 handler records the cluster's pre-emption notice (here a simulated scheduler
sends it to the first local process after a short time), and when the notice is seen the
trainer gathers every rank's RNG state, writes a resume checkpoint and stops cleanly."""
import datetime
import os
import signal
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

CKPT = os.path.join(tempfile.gettempdir(), f"preempt_{os.environ.get('TORCHELASTIC_RUN_ID', 'x')}.pt")


class PreemptionHandler:
    def __init__(self):
        self.requested = False
        signal.signal(signal.SIGUSR1, self._on_signal)

    def _on_signal(self, signum, frame):
        self.requested = True


def simulated_scheduler_notice(delay):
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGUSR1)).start()


def save_resume(model, opt, step, rank):
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, torch.get_rng_state())
    if rank == 0:
        torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step,
                    "rng": states}, CKPT)
        print(f"saved resume checkpoint at step {step}", flush=True)


def train(rank):
    handler = PreemptionHandler()
    simulated_scheduler_notice(1.5)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    for step in range(200):
        x = torch.randn(32, 16, generator=g)
        loss = nn.functional.mse_loss(model(x), x[:, :4].sum(dim=1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.05)
        flag = torch.tensor([1.0 if handler.requested else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            save_resume(model, opt, step, rank)
            break
    if rank == 0:
        print(f"stopped at step {step}, loss {loss.item():.4f}", flush=True)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    train(dist.get_rank())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
