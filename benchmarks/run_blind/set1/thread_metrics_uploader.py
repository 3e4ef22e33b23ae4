"""DDP training where rank 0 ships metrics to a collector from a background
thread so that logging never blocks the training step."""
import atexit
import datetime
import queue
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


class MetricsUploader:
    def __init__(self, flush_every=0.5):
        self.q = queue.Queue()
        self.flush_every = flush_every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-uploader")
        self._thread.start()
        atexit.register(self.close)

    def log(self, **kv):
        self.q.put((time.time(), kv))

    def _run(self):
        sent = 0
        while not self._stop.is_set():
            time.sleep(self.flush_every)
            while not self.q.empty():
                self.q.get()
                sent += 1
        print(f"uploader sent {sent} records", flush=True)

    def close(self):
        self._stop.set()
        self._thread.join()


def train(rank, uploader):
    torch.manual_seed(rank)
    model = DDP(nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(20):
        x = torch.randn(16, 32)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if uploader is not None:
            uploader.log(step=step, loss=loss.item())


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    rank = dist.get_rank()
    uploader = MetricsUploader() if rank == 0 else None
    train(rank, uploader)
    dist.barrier()
    print(f"rank {rank} finished training", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
