"""Small DDP regression job. Rank 0 builds the sample index in a helper thread
and reads it through libc so the other ranks get the same ordering."""
import ctypes
import ctypes.util
import datetime
import os
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

_libc = ctypes.PyDLL(ctypes.util.find_library("c"))
_libc.read.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
_libc.read.restype = ctypes.c_ssize_t


def produce_index(fd, n, seed):
    time.sleep(0.5)  # pretend to scan the dataset
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    payload = b"".join(i.to_bytes(4, "little") for i in order)
    os.write(fd, len(payload).to_bytes(4, "little") + payload)
    os.close(fd)


def read_exact(fd, n):
    buf = ctypes.create_string_buffer(n)
    got = 0
    while got < n:
        r = _libc.read(fd, ctypes.addressof(buf) + got, n - got)
        if r <= 0:
            raise IOError("index stream ended early")
        got += r
    return buf.raw


def load_index(n, seed=0):
    rfd, wfd = os.pipe()
    producer = threading.Thread(target=produce_index, args=(wfd, n, seed))
    producer.start()
    size = int.from_bytes(read_exact(rfd, 4), "little")
    data = read_exact(rfd, size)
    producer.join()
    os.close(rfd)
    return [int.from_bytes(data[i:i + 4], "little") for i in range(0, size, 4)]


def train(rank, world, index):
    torch.manual_seed(0)
    x = torch.randn(256, 16)
    y = x @ torch.randn(16, 1)
    model = DDP(nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mine = index[rank::world]
    for step in range(0, len(mine), 16):
        idx = torch.tensor(mine[step:step + 16])
        loss = nn.functional.mse_loss(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    if rank == 0:
        print(f"final loss {loss.item():.4f}", flush=True)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    holder = [None]
    if rank == 0:
        holder[0] = load_index(256)
    dist.broadcast_object_list(holder, src=0)
    train(rank, world, holder[0])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
