"""A phase-end helper destroys the default process group; training goes on.

Mechanism (e), BROKEN (crashes on its own, both ranks). The DDP model uses the
stock `allreduce_hook` comm hook with state=None, which resolves
`dist.group.WORLD` at every bucket. `end_of_phase()` -- written for the end of
the run -- checkpoints and calls dist.destroy_process_group(). It is called
after the warm-up phase too. (On Gloo the destroyed group's backend keeps
working, so DDP's own reducer would not notice; the hook does.) The first
loss.backward() of the main phase raises inside the comm hook:
`AttributeError: 'NoneType' object has no attribute 'size'`
(torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py, `_allreduce_fut`).

Drawn from: https://github.com/pytorch/pytorch/pull/122358 ("[C10D] Document
destroy_process_group usage": "It has already been a source of confusion") and
https://github.com/Lightning-AI/pytorch-lightning/issues/16922 (a teardown
destroys the default WORLD group while other users of it remain).
"""
import os

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

PHASES = [("warmup", 3, 1e-3), ("main", 6, 1e-2)]


def end_of_phase(name, model):
    if dist.get_rank() == 0:
        torch.save(model.module.state_dict(), os.devnull)
    dist.barrier()
    dist.destroy_process_group()  # zoo: destroy
    print(f"phase {name} finished", flush=True)


def run():
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.SiLU(), torch.nn.Linear(24, 3)))
    model.register_comm_hook(state=None, hook=default_hooks.allreduce_hook)
    gen = torch.Generator().manual_seed(rank)
    for name, steps, lr in PHASES:
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        for step in range(steps):
            x = torch.randn(24, 12, generator=gen)
            loss = model(x).logsumexp(1).mean()
            opt.zero_grad()
            loss.backward()  # zoo: backward-after-destroy
            opt.step()
        end_of_phase(name, model)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    run()
