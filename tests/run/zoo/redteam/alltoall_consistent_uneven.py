# nproc: 3
"""Uneven but consistent all_to_all_single (counts exchanged first). HEALTHY.

Mechanism (h): every rank sends a different number of rows to every peer and
the ranks' input split sizes are all different, which a naive per-rank shape
comparison would flag. The receive splits are obtained from an all_to_all of
the counts, so they are the transpose of the send splits and the exchange is
correct; the received rows are checked. Exit code 0 on all 3 ranks.

Drawn from: https://github.com/pytorch/pytorch/pull/32361 (the uneven
all_to_all_single example: "output_splits should be transpose of
input_splits") and https://github.com/pytorch/pytorch/pull/43256 (Gloo support
for all_to_all_single with split sizes).
"""
import os

import torch
import torch.distributed as dist

COLS = 3


def plan(rank, world, round_):
    # rows this rank sends to each destination: deliberately all different
    return [(rank * 2 + dst + round_) % 4 + 1 for dst in range(world)]


def exchange(rank, world, round_):
    send_counts = plan(rank, world, round_)
    payload = torch.cat([
        torch.full((n, COLS), float(100 * rank + dst)) for dst, n in enumerate(send_counts)
    ])
    counts_out = torch.tensor(send_counts, dtype=torch.int64)
    counts_in = torch.empty(world, dtype=torch.int64)
    dist.all_to_all_single(counts_in, counts_out)  # zoo: a2a-counts
    recv_counts = counts_in.tolist()
    recv = torch.empty(sum(recv_counts), COLS)
    dist.all_to_all_single(recv, payload, recv_counts, send_counts)  # zoo: a2a-uneven
    for src, chunk in enumerate(recv.split(recv_counts)):
        assert chunk.shape[0] == plan(src, world, round_)[rank]
        assert torch.all(chunk == 100 * src + rank), (src, chunk)
    return send_counts, recv_counts


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for r in range(5):
        sent, got = exchange(rank, world, r)
        if r == 0:
            print(f"rank {rank}: sends {sent}, receives {got}", flush=True)
    ok = torch.ones(1)
    dist.all_reduce(ok)
    assert int(ok.item()) == world
    if rank == 0:
        print("all exchanges verified", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
