"""DDP training that stages each batch in a malloc'ed host buffer (as a
native I/O library would) before handing it to the model."""
import ctypes
import ctypes.util
import datetime

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

_libc = ctypes.CDLL(ctypes.util.find_library("c"))
_libc.malloc.restype = ctypes.c_void_p
_libc.malloc.argtypes = [ctypes.c_size_t]
_libc.free.argtypes = [ctypes.c_void_p]


class StagingBuffer:
    def __init__(self, nbytes):
        self.nbytes = nbytes
        self.ptr = _libc.malloc(nbytes)

    def fill_from(self, t):
        ctypes.memmove(self.ptr, t.data_ptr(), self.nbytes)

    def as_tensor(self, shape):
        arr = (ctypes.c_float * (self.nbytes // 4)).from_address(self.ptr)
        return torch.frombuffer(arr, dtype=torch.float32).view(shape).clone()

    def release(self):
        _libc.free(self.ptr)


def make_batches(rank, n=8):
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randn(8, 16, generator=g) for _ in range(n)]
    if rank == 1:
        batches[3][2, 5] = float("nan")
    return batches


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    rank = dist.get_rank()
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step, batch in enumerate(make_batches(rank)):
        staging = StagingBuffer(batch.numel() * 4)
        try:
            staging.fill_from(batch)
            x = staging.as_tensor(batch.shape)
            if not torch.isfinite(x).all():
                print(f"rank {rank}: skipping non-finite batch {step}", flush=True)
                staging.release()
                x = torch.zeros_like(x)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        finally:
            staging.release()
    print(f"rank {rank} done", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
