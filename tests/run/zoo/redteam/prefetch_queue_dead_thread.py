"""Rank 0's prefetch thread dies; its main thread waits on queue.get() forever.

Mechanism (c), BROKEN (hangs forever). A background thread reads "shards" into
a queue.Queue. On rank 0 the manifest lacks shard 4, the thread raises
KeyError and ends (Python prints "Exception in thread shard-prefetch" on
stderr and carries on). The main thread then blocks in `queue.get()` with no
producer left: rank 0 is idle, uses no CPU, and has no live helper thread.
Rank 1 trains its step 4 and waits in the gradient all_reduce.

Drawn from: https://github.com/pytorch/pytorch/issues/87995 ("rank0 will hang
at dataloader ... all other ranks will wait because of all_reduce()"; rank 0's
MainThread stack: `wait (threading.py:302)` / `get (queue.py:170)`).
"""
import os
import queue
import threading

import torch
import torch.distributed as dist

RANK = int(os.environ["RANK"])


def manifest_for(rank):
    shards = {i: f"s3://bucket/train/{rank}/{i:05d}.pt" for i in range(8)}
    if rank == 0:
        del shards[4]  # the listing for rank 0 was truncated
    return shards


class ShardPrefetcher(threading.Thread):
    def __init__(self, manifest, out, n_shards):
        super().__init__(name="shard-prefetch", daemon=True)
        self.manifest, self.out, self.n = manifest, out, n_shards

    def run(self):
        for i in range(self.n):
            path = self.manifest[i]  # KeyError for rank 0, shard 4
            g = torch.Generator().manual_seed(hash(path) % (1 << 31))
            self.out.put(torch.randn(64, 12, generator=g))


def grads_allreduce(params, world):
    for p in params:
        dist.all_reduce(p.grad)  # zoo: peer-wait
        p.grad /= world


def main():
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Linear(12, 3)
    for p in model.parameters():
        dist.broadcast(p.data, 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    q = queue.Queue(maxsize=2)
    ShardPrefetcher(manifest_for(RANK), q, n_shards=8).start()
    for step in range(8):
        batch = q.get()  # zoo: idle-get
        target = batch[:, :3].cumsum(1)
        loss = torch.nn.functional.mse_loss(model(batch), target)
        opt.zero_grad()
        loss.backward()
        grads_allreduce(model.parameters(), world)
        opt.step()
        print(f"rank {RANK} step {step} loss {loss.item():.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
