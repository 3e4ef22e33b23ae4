"""Hybrid-parallel bootstrap: build the process groups described in a layout
table, then train the data-parallel replica with the 'dp' group."""
import datetime

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401
import torch.nn as nn

LAYOUT = {
    "embed_owner": [0],
    "dp": [0, 1],
    "head_owner": [1],
}


def build_groups(rank):
    mine = [name for name, ranks in LAYOUT.items() if rank in ranks]
    others = [name for name, ranks in LAYOUT.items() if rank not in ranks]
    groups = {}
    for name in mine + others:
        groups[name] = dist.new_group(ranks=LAYOUT[name], backend="gloo")
    return groups


def average_gradients(model, group):
    size = dist.get_world_size(group)
    for p in model.parameters():
        dist.all_reduce(p.grad, group=group)
        p.grad /= size


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    rank = dist.get_rank()
    groups = build_groups(rank)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    for step in range(10):
        x = torch.randn(16, 8, generator=g)
        loss = (model(x) - x.mean(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        average_gradients(model, groups["dp"])
        opt.step()
    print(f"rank {rank} loss {loss.item():.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
