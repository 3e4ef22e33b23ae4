"""Rank 1 waits on a threading.Event that its checkpoint thread never sets.

Mechanism (c), BROKEN (hangs forever). The last rank owns an asynchronous
checkpoint writer. The main thread files the job under "step-2" but the writer
polls for "step_2"; it stays alive, waking every 50 ms (a few per cent of a
core at most) and never sets `written`. Rank 1's main thread blocks in
`written.wait()`; rank 0 has gone on to `dist.barrier()`.

Drawn from: https://github.com/pytorch/pytorch/issues/87995 (a rank's
MainThread idle in `threading.py` wait while all others wait in all_reduce)
and https://github.com/ray-project/ray/issues/52641 (deadlock stack: main
training thread idle in a queue/condition wait, a helper thread alive but
waiting too).
"""
import os
import threading
import time

import torch
import torch.distributed as dist


class AsyncCheckpointer:
    def __init__(self):
        self.jobs = {}
        self.written = threading.Event()
        self._want = None
        self._t = threading.Thread(target=self._loop, name="ckpt-writer", daemon=True)
        self._t.start()

    def _loop(self):
        while True:
            key = self._want
            if key is not None and key in self.jobs:
                state = self.jobs.pop(key)
                torch.save(state, os.devnull)
                self.written.set()
            time.sleep(0.05)

    def submit(self, step, state):
        self.jobs[f"step-{step}"] = state  # main thread: hyphen
        self._want = f"step_{step}"  # writer looks for: underscore

    def wait(self):
        self.written.wait()  # zoo: idle-event


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    writer = AsyncCheckpointer() if rank == world - 1 else None
    net = torch.nn.Sequential(torch.nn.Linear(5, 5), torch.nn.GELU(), torch.nn.Linear(5, 1))
    for p in net.parameters():
        dist.broadcast(p.data, src=0)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    for step in range(6):
        x = torch.randn(20, 5)
        loss = net(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        for p in net.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        if step == 2 and writer is not None:
            writer.submit(step, {k: v.clone() for k, v in net.state_dict().items()})
            writer.wait()
        dist.barrier()  # zoo: peer-wait
        print(f"rank {rank} step {step}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
