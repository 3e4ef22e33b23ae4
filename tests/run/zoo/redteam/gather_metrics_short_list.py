"""all_gather_object with an output list one slot too short on rank 1.

Mechanism (d, variant without a Gloo abort): the two ranks pass object lists of
different LENGTH to the same all_gather_object. The tensor collectives inside
it agree (sizes are gathered first, then max-size byte tensors), so Gloo is
happy; but rank 1 sized its list for "the other ranks" only, and after both
collectives have completed, torch's unpickling loop raises on rank 1
`IndexError: list assignment index out of range`. Rank 0 has its full list,
goes on to the next step and waits in its all_reduce for a rank that has
crashed.

Expected diagnosis: rank_crashed (rank 1, IndexError at the all_gather_object
line) -- not a mismatch, and not a consequence, although the exception comes
out of a collective call.

Drawn from: https://github.com/pytorch/pytorch/pull/42189 (all_gather_object:
the output list "should be correctly sized as the size of the group") and
https://github.com/PaddlePaddle/Paddle/pull/44718 (object all-gather with
per-rank objects of different lengths).
"""
import dataclasses
import os

import torch
import torch.distributed as dist


@dataclasses.dataclass
class EvalMetrics:
    rank: int
    n: int
    correct: int
    worst_ids: list


def evaluate(model, rank):
    g = torch.Generator().manual_seed(50 + rank)
    x = torch.randn(64, 4, generator=g)
    y = (x[:, 0] > 0).long()
    with torch.no_grad():
        pred = model(x).argmax(1)
    wrong = (pred != y).nonzero().flatten().tolist()
    return EvalMetrics(rank, len(y), int((pred == y).sum()), wrong[: 3 + 5 * rank])


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = torch.nn.Linear(4, 2)
    for p in model.parameters():
        dist.broadcast(p.data, 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for epoch in range(3):
        g = torch.Generator().manual_seed(epoch * 10 + rank)
        x = torch.randn(64, 4, generator=g)
        loss = torch.nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long())
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)  # zoo: peer-wait
            p.grad /= world
        opt.step()

        mine = evaluate(model, rank)
        # rank 0 keeps a slot for itself; the others "only need the peers'"
        slots = world if rank == 0 else world - 1
        everyone = [None] * slots
        dist.all_gather_object(everyone, mine)  # zoo: gather-obj
        if rank == 0:
            acc = sum(m.correct for m in everyone) / sum(m.n for m in everyone)
            print(f"epoch {epoch}: global accuracy {acc:.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
