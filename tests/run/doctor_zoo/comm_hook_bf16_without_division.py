"""A hand-written bf16 compression hook that forgets the division by the world size.

Intent: halve the gradient traffic. The script casts each bucket to bfloat16, all-reduces it and
writes the result back into the bucket, as torch's own fp16 hook does, but without the hook's
first line (`buffer.div_(world_size)`).

What goes wrong: what the hook returns is the SUM of the ranks' gradients (rounded to bf16), 2x
the average here. Nothing fails and the replicas agree; every update is world_size times too large
(with Adam it hides in the step size until weight decay and clipping meet it).

Public report: https://github.com/pytorch/pytorch/issues/56981 (users copying fp16_compress_hook
and dropping the pre-division), and the hook in torch/distributed/algorithms/ddp_comm_hooks/
default_hooks.py that divides first.

Expected verdict (ideal checker): the hook returns world_size x the average; cause: the hook's
all_reduce (marked).
"""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def bf16_hook(state, bucket):
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16)
    future = dist.all_reduce(compressed, async_op=True).get_future()  # doctor: cause

    def decompress(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return future.then(decompress)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(12, 48), nn.ReLU(), nn.Linear(48, 3)))
    model.register_comm_hook(state=None, hook=bf16_hook)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    data = torch.Generator().manual_seed(11 + rank)
    for step in range(30):
        x = torch.randn(24, 12, generator=data)
        y = (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long()
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
