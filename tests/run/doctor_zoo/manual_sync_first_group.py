"""Hand-written gradient averaging only covers the first optimizer param group.

Intent: no DDP; the user broadcasts the initial weights from rank 0 and
averages gradients by hand after `backward()` (the classic
`average_gradients` recipe). Later they split the parameters into a
weight-decay group and a no-decay group (biases and LayerNorm), and the sync
loop was rewritten to iterate over "the optimizer's params".

What goes wrong: the loop walks `opt.param_groups[0]["params"]` only. The
no-decay group (every bias and both LayerNorm parameters) is never averaged,
so those tensors are updated from rank-local gradients and drift apart from
step 1, while the weight matrices stay in sync.

Public report: https://github.com/pytorch/examples/issues/483 ("different node
has different parameters", manual gradient averaging after backward); see
also https://github.com/deepmodeling/deepmd-kit/pull/1104 (gradients not
averaged in parallel training).

Expected verdict (ideal checker): gradients of the no-decay parameters
(`0.bias`, `1.weight`, `1.bias` [LayerNorm], `3.bias`) are never averaged
across ranks; those parameters differ across ranks after step 1, the other
weights stay identical. Cause: the loop line marked with the zoo cause marker.

Plain torchrun (measured, `torchrun --standalone --nproc-per-node 2`, CPU,
gloo): exit 0, 32 steps/rank, ~18-33 s. Decay-group checksum -0.66626284 on
both ranks; no-decay-group checksum rank 0 = 65.02363414, rank 1 =
64.82400083; probe: parameters differ from step 1.
"""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def make_data(n=512):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 16, generator=g)
    y = (x[:, :8].sum(1) > 0).long()
    return TensorDataset(x, y)


def average_gradients(optimizer, world):
    for p in optimizer.param_groups[0]["params"]:  # doctor: cause
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad /= world


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world = dist.get_world_size()

    torch.manual_seed(rank)  # init differs per rank; broadcast below
    model = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 2))
    for p in model.parameters():
        dist.broadcast(p.data, src=0)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([
        {"params": decay, "weight_decay": 0.05},
        {"params": no_decay, "weight_decay": 0.0},
    ], lr=2e-3)

    ds = make_data()
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=16, sampler=sampler)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            average_gradients(opt, world)
            opt.step()
        print(f"[rank {rank}] epoch {epoch} loss {loss.item():.4f}", flush=True)

    cd = sum(p.detach().double().sum().item() for p in decay)
    cn = sum(p.detach().double().sum().item() for p in no_decay)
    print(f"[rank {rank}] decay-group checksum {cd:.8f} no-decay-group checksum {cn:.8f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
