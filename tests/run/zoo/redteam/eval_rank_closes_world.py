"""The eval rank "closes its eval group", which is None: it destroys WORLD.

Mechanism (e), BROKEN (rank 1 crashes on its own; rank 0 is a bystander).
The last rank runs a side evaluation and then calls
`dist.destroy_process_group(self.eval_group)`. Evaluation groups are only
created when EVAL_GROUP=1, so `eval_group` is None and None means "destroy
everything". DDP keeps working on Gloo, but the fp16_compress_hook (state=None)
looks up `dist.group.WORLD` on every bucket, so rank 1's next loss.backward()
raises `AttributeError: 'NoneType' object has no attribute 'size'`. Rank 0 is
already waiting in its fp16 bucket all-reduce of the same step; it sees the
peer vanish ("Connection closed by peer") or is stopped by torchrun first.

Drawn from: https://github.com/pytorch/pytorch/pull/122358 (destroy_process_group
semantics with the default None "destroy every process group and backend") and
https://github.com/Lightning-AI/pytorch-lightning/issues/16922 (tearing down a
collective destroys the default WORLD group that others still use).
"""
import os

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.nn.parallel import DistributedDataParallel as DDP


class Trainer:
    def __init__(self):
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.is_eval_rank = self.rank == self.world - 1
        self.eval_group = dist.new_group([self.world - 1]) if os.environ.get("EVAL_GROUP") == "1" else None
        torch.manual_seed(3)
        self.model = DDP(torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16)))
        self.model.register_comm_hook(None, fp16_compress_hook)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.gen = torch.Generator().manual_seed(self.rank)

    def side_eval(self):
        with torch.no_grad():
            x = torch.randn(64, 16, generator=self.gen)
            err = (self.model.module(x) - x).pow(2).mean().item()
        print(f"[eval rank {self.rank}] recon err {err:.4f}", flush=True)
        dist.destroy_process_group(self.eval_group)  # zoo: destroy

    def step(self):
        x = torch.randn(32, 16, generator=self.gen)
        loss = (self.model(x) - x).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()  # zoo: backward-after-destroy
        self.opt.step()
        return loss.item()

    def fit(self, steps=8):
        for s in range(steps):
            loss = self.step()
            if s == 2 and self.is_eval_rank:
                self.side_eval()
            print(f"rank {self.rank} step {s} loss {loss:.4f}", flush=True)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    Trainer().fit()
    dist.destroy_process_group()
