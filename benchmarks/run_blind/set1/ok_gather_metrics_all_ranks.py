"""Minimal accelerator-style wrapper around DDP with a gather_for_metrics
helper, used for a train/eval loop."""
import datetime

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


class MiniAccelerator:
    def __init__(self):
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        torch.set_num_threads(1)
        self.process_index = dist.get_rank()
        self.num_processes = dist.get_world_size()

    @property
    def is_main_process(self):
        return self.process_index == 0

    def prepare(self, model):
        return DDP(model)

    def gather_for_metrics(self, t, total=None):
        out = [torch.empty_like(t) for _ in range(self.num_processes)]
        dist.all_gather(out, t.contiguous())
        full = torch.cat(out)
        return full[:total] if total is not None else full

    def wait_for_everyone(self):
        dist.barrier()

    def end(self):
        dist.destroy_process_group()


def evaluate(acc, model, xs, ys):
    model.eval()
    with torch.no_grad():
        preds = model(xs).argmax(1)
    preds, labels = acc.gather_for_metrics(preds), acc.gather_for_metrics(ys)
    model.train()
    return (preds == labels).float().mean().item()


def fit(acc):
    torch.manual_seed(0)
    model = acc.prepare(nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 3)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(acc.process_index)
    val_x = torch.randn(30, 20, generator=g)
    val_y = val_x[:, :3].argmax(1)
    for epoch in range(3):
        for _ in range(10):
            x = torch.randn(32, 20, generator=g)
            loss = nn.functional.cross_entropy(model(x), x[:, :3].argmax(1))
            opt.zero_grad()
            loss.backward()
            opt.step()
        val_acc = evaluate(acc, model, val_x, val_y)
        if acc.is_main_process:
            print(f"epoch {epoch} loss {loss.item():.4f} val_acc {val_acc:.3f}", flush=True)
        acc.wait_for_everyone()


def main():
    acc = MiniAccelerator()
    fit(acc)
    acc.wait_for_everyone()
    acc.end()


if __name__ == "__main__":
    main()
