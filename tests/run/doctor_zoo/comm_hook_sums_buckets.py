"""A custom DDP comm hook that all-reduces each bucket and returns the sum.

Intent: the team wanted to time the gradient exchange, so they replaced DDP's own reduction with a
hook written from the comm-hook tutorial's skeleton: all_reduce the bucket asynchronously and hand
DDP the future's tensor.

What goes wrong: DDP's own reduction divides by the world size; a registered hook replaces it, and
DDP copies whatever the hook returns into `.grad`. This hook never divides, so every gradient is
the SUM over the ranks (2x the average here). The replicas stay identical and the loss falls, just
with an effective learning rate that grows with the number of GPUs.

Public report: https://github.com/pytorch/pytorch/issues/39272 (custom allreduce hooks that forget
to divide by the world size, discussed with DDP communication hooks' design), and the pattern of
https://discuss.pytorch.org/t/ddp-comm-hook-gradients-not-averaged/ .

Expected verdict (ideal checker): the hook returns world_size x the ranks' average gradient; cause:
the hook's `dist.all_reduce` line (marked).
"""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def timed_allreduce_hook(process_group, bucket):
    tensor = bucket.buffer()
    work = dist.all_reduce(tensor, group=process_group, async_op=True)  # doctor: cause
    return work.get_future().then(lambda fut: fut.value()[0])


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1)), bucket_cap_mb=0.004)
    model.register_comm_hook(None, timed_allreduce_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    target = torch.randn(16, 1, generator=torch.Generator().manual_seed(7))
    data = torch.Generator().manual_seed(100 + rank)
    for step in range(30):
        x = torch.randn(32, 16, generator=data)
        loss = F.mse_loss(model(x), x @ target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
