"""A tensor backward hook issues an all_reduce on rank 0 only.

Mechanism (d), BROKEN. Manual data parallelism (no DDP): after backward, every
rank all-reduces one flat buffer of all gradients (5569 floats). The logging
rank (0) additionally registered a hook on the hidden activation that
all-reduces the activation gradient (32 x 64 = 2048 floats) "to log the global
gradient norm". Inside loss.backward() rank 0 enters that extra all_reduce,
which pairs with rank 1's flat-gradient all_reduce: same op, different tensors,
different lines. Gloo receives a bigger chunk than rank 0 posted and aborts.

Drawn from: https://github.com/huggingface/picotron/issues/39 (all_reduce
issued from a gradient hook) and https://github.com/pytorch/gloo/pull/456
(Gloo's "op.preamble.length <= op.nbytes" on a collective mismatch).
"""
import os

import torch
import torch.distributed as dist
from torch import nn

torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self, probe=None):
        super().__init__()
        self.fc1 = nn.Linear(20, 64)
        self.fc2 = nn.Linear(64, 64)
        self.out = nn.Linear(64, 1)
        self.probe = probe

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if self.probe is not None and h.requires_grad:
            h.register_hook(self.probe)
        h = torch.relu(self.fc2(h))
        return self.out(h)


def global_grad_probe(grad):
    g = grad.detach().clone()
    dist.all_reduce(g)  # zoo: hook-allreduce
    print(f"global activation-grad norm {g.norm():.4f}", flush=True)


def sync_gradients(model, world):
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    dist.all_reduce(flat)  # zoo: grad-sync
    flat /= world
    offset = 0
    for p in model.parameters():
        n = p.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p))
        offset += n


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    model = Net(probe=global_grad_probe if rank == 0 else None)
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    for step in range(5):
        x = torch.randn(32, 20, generator=gen)
        y = x[:, :1] - x[:, 1:2]
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()  # zoo: backward
        sync_gradients(model, world)
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
