"""Profiled MLP training on 2 ranks: rank 0 attaches a small native step tracer (a C
library compiled at start-up whose background thread flushes step timestamps to a trace
file) for a window of steps, both ranks train a DDP-wrapped MLP on synthetic regression
data, and rank 0 prints the number of traced steps at the end."""
import ctypes
import datetime
import os
import subprocess
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

C_SRC = r"""
#include <pthread.h>
#include <stdio.h>
#include <unistd.h>
static pthread_t th;
static volatile int active = 0, stop_flag = 0, steps = 0;
static FILE *out;

static void *flusher(void *arg) {
    (void)arg;
    while (!stop_flag) {
        usleep(50000);
        if (out) fflush(out);
    }
    return 0;
}

int tracer_start(const char *path) {
    out = fopen(path, "w");
    stop_flag = 0;
    active = 1;
    return pthread_create(&th, 0, flusher, 0);
}

void tracer_mark(long step) {
    if (out) fprintf(out, "%ld\n", step);
    steps++;
}

int tracer_steps(void) { return steps; }

void tracer_stop(void) {
    if (!active) return;
    stop_flag = 1;
    pthread_join(th, 0);
    active = 0;
    if (out) fclose(out);
    out = 0;
}

__attribute__((destructor)) static void tracer_fini(void) {
    if (active) pthread_join(th, 0);
}
"""
TRACE_START, TRACE_STOP = 5, 40
STEPS = 30


class Tracer:
    def __init__(self):
        d = tempfile.mkdtemp(prefix="tracer_")
        with open(os.path.join(d, "t.c"), "w") as f:
            f.write(C_SRC)
        so = os.path.join(d, "libtracer.so")
        subprocess.check_call(["gcc", "-O2", "-shared", "-fPIC", "-pthread", "-o", so, os.path.join(d, "t.c")])
        self.lib = ctypes.CDLL(so)
        self.lib.tracer_start.argtypes = [ctypes.c_char_p]
        self.lib.tracer_mark.argtypes = [ctypes.c_long]
        self.path = os.path.join(d, "steps.trace")

    def on_step(self, step):
        if step == TRACE_START:
            self.lib.tracer_start(self.path.encode())
        if TRACE_START <= step < TRACE_STOP:
            self.lib.tracer_mark(step)
        if step == TRACE_STOP:
            self.lib.tracer_stop()


def train(rank):
    tracer = Tracer() if rank == 0 else None
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    for step in range(STEPS):
        x = torch.randn(32, 16, generator=g)
        y = x.sum(dim=1, keepdim=True)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if tracer is not None:
            tracer.on_step(step)
    if tracer is not None:
        print(f"traced {tracer.lib.tracer_steps()} steps, final loss {loss.item():.4f}", flush=True)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    train(dist.get_rank())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
