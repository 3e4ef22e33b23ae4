"""Rank 1 swallows a data error and returns from main; rank 0 waits at a barrier.

Mechanism (g), BROKEN. At the start of epoch 2, rank 1 hits a corrupt record
in its shard. The loader wraps it in `ShardError`, main() catches it, logs
"skipping the rest of training" and returns normally -- the process group is
destroyed in the `finally:` and rank 1 exits with status 0. Rank 0 loaded its
shard fine and waits in the epoch-start barrier for a rank that has finished.
Under plain torchrun the barrier fails once rank 1's process is gone
("Connection closed by peer"), so rank 0 exits 1 although rank 1 is the one
that quit.

Drawn from: https://github.com/Lightning-AI/pytorch-lightning/issues/6430
("Expected behavior when 1 rank crashes in distributed training?": the train
loop is wrapped in try/catch, "if one rank raises an exception but not all,
that one rank goes through the ... flow and hangs") and
https://github.com/pytorch/pytorch/issues/138322 (a rank that has nothing left
to do exits; the others hang on the barrier).
"""
import os
import sys

import torch
import torch.distributed as dist


class ShardError(Exception):
    pass


def read_shard(rank, epoch):
    g = torch.Generator().manual_seed(100 * epoch + rank)
    records = torch.randn(40, 5, generator=g)
    if rank == 1 and epoch == 2:
        records[17, 2] = float("nan")  # corrupt record
    bad = torch.isnan(records).any(1)
    if bad.any():
        raise ShardError(f"rank {rank}: corrupt record {int(bad.nonzero()[0])} in epoch {epoch}")
    return records


def fit(rank, world):
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(layer.parameters(), lr=0.05)
    for epoch in range(4):
        data = read_shard(rank, epoch)
        dist.barrier()  # zoo: peer-wait
        for chunk in data.split(8):
            loss = (layer(chunk[:, :4]).squeeze(1) - chunk[:, 4]).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            for p in layer.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
            opt.step()
        print(f"rank {rank} epoch {epoch} loss {loss.item():.3f}", flush=True)


def main():
    dist.init_process_group("gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        fit(rank, world)
    except ShardError as err:
        print(f"WARNING {err}; skipping the rest of training", file=sys.stderr, flush=True)
        return 0  # zoo: early-return
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
