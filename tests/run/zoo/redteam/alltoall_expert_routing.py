"""MoE token dispatch with all_to_all_single whose split sizes disagree.

Mechanism (d), BROKEN. Each rank hosts one expert. Tokens are routed by a
router; the number of tokens a rank SENDS to each expert is exact, but the
number it expects to RECEIVE is assumed to be the fixed capacity (2 per peer)
instead of being exchanged first. Batch 0 happens to fit ([2,2] on both ranks)
and works. In batch 1 rank 1 routes 3 tokens to rank 0's expert while rank 0
expects 2: both ranks are in the same all_to_all_single at the same line with
split sizes that do not agree (rank 0: in [2,2] out [2,2]; rank 1: in [3,2]
out [2,2]). Gloo gets 3 rows where rank 0 posted room for 2 and aborts.

Drawn from: https://github.com/pytorch/pytorch/issues/117486
("all_to_all_single stuck when use specials output_split_sizes and
input_split_sizes" -- "a wrong usecase that split_sizes mismatch on different
ranks") and https://github.com/pytorch/pytorch/issues/194559 (no tool names the
mismatched all-to-all pair).
"""
import os

import torch
import torch.distributed as dist

HIDDEN = 8
CAPACITY = 2

# (rank, batch) -> expert id of each token; batch 1 on rank 1 is "hot" for expert 0
ROUTES = {
    (0, 0): [0, 1, 0, 1],
    (1, 0): [1, 0, 0, 1],
    (0, 1): [0, 0, 1, 1],
    (1, 1): [0, 1, 0, 0, 1],
}


def tokens_for(rank, batch):
    experts = torch.tensor(ROUTES[(rank, batch)])
    x = torch.nn.functional.one_hot(experts, 2).float() * 3.0
    noise = torch.randn(len(experts), HIDDEN - 2, generator=torch.Generator().manual_seed(batch))
    return torch.cat([x, noise * 0.01], dim=1)


def dispatch(x, router, world):
    expert = router(x[:, :2]).argmax(dim=1)
    order = torch.argsort(expert, stable=True)
    send = x[order].contiguous()
    in_splits = torch.bincount(expert, minlength=world).tolist()
    out_splits = [CAPACITY] * world  # BUG: assumes every peer sends exactly CAPACITY
    recv = torch.empty(sum(out_splits), HIDDEN)
    dist.all_to_all_single(recv, send, out_splits, in_splits)  # zoo: a2a
    return recv, in_splits


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    router = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        router.weight.copy_(torch.eye(2))
    expert = torch.nn.Linear(HIDDEN, HIDDEN)
    for batch in range(2):
        x = tokens_for(rank, batch)
        recv, splits = dispatch(x, router, world)
        y = expert(recv)
        print(f"rank {rank} batch {batch}: sent {splits}, expert out {tuple(y.shape)}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
