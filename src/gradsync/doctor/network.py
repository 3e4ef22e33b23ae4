"""The doctor's network tests between ranks: a short all-reduce sweep and a pairwise ping-pong.

The all-reduce reuses `gradsync bench allreduce`'s measurement with two sizes only: a small
message for the latency, a large one for the bus bandwidth. The pairwise test finds the slow
link an all-reduce hides (a ring runs at its slowest link's speed but does not say which):
every pair of ranks sends a message back and forth a few times. Pairs run in rounds of
disjoint pairs (the circle schedule of a round-robin tournament), so N ranks take N-1 rounds
(N for an odd N, one rank sitting out each round) instead of N(N-1)/2 pair tests one after the
other, and in a round every rank talks to one partner only, which loads each host's link alike.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gradsync.bench.allreduce import SweepConfig, measure
from gradsync.doctor.checks import AllReduceResult, PairResult
from gradsync.metrics.timing import synchronized_time

# 1 KiB (latency) and 16 MiB (bandwidth), about 0.2 s of timed iterations each.
ALLREDUCE_SWEEP = SweepConfig(
    min_bytes=1 << 10, max_bytes=16 << 20, factor=1 << 14, warmup=2, min_iters=3, max_iters=20, target_s=0.2
)
PAIR_BYTES = 4 << 20
PAIR_REPEATS = 3


def allreduce_test(device: torch.device, backend: str, group: Any = None,
                   config: SweepConfig = ALLREDUCE_SWEEP) -> AllReduceResult:
    """Every rank calls it; the times are the slowest rank's (as in `gradsync bench allreduce`)."""
    results = measure(config, device, group)
    small, large = results[0], results[-1]
    return AllReduceResult(
        backend=backend, world_size=dist.get_world_size(group), small_bytes=small.bytes, small_s=small.time_s,
        large_bytes=large.bytes, large_s=large.time_s, busbw_gbps=large.busbw_gbps,
    )


def circle_schedule(world_size: int) -> list[list[tuple[int, int]]]:
    """Rounds of disjoint pairs (a < b) that together hold every pair exactly once."""
    players: list[int | None] = list(range(world_size))
    if len(players) % 2:
        players.append(None)  # the rank paired with None sits the round out
    n = len(players)
    rounds = []
    for _ in range(n - 1):
        pairs = []
        for i in range(n // 2):
            a, b = players[i], players[n - 1 - i]
            if a is not None and b is not None:
                pairs.append((min(a, b), max(a, b)))
        rounds.append(pairs)
        players = [players[0], players[-1], *players[1:-1]]  # keep the first, rotate the others
    return rounds


def pairwise_test(rank: int, world_size: int, device: torch.device, group: Any = None,
                  nbytes: int = PAIR_BYTES, repeats: int = PAIR_REPEATS) -> list[PairResult]:
    """Ping-pong with every other rank; returns the pairs where this rank is the lower one.

    Every rank calls it with the same arguments. A round ends with a barrier so rounds do not overlap.
    """
    buffer = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    mine = []
    for pairs in circle_schedule(world_size):
        partner = next((b if a == rank else a for a, b in pairs if rank in (a, b)), None)
        if partner is not None:
            _exchange(buffer, rank, partner, group)  # warm-up: first use of the pair's connection
            started = synchronized_time(device)
            for _ in range(repeats):
                _exchange(buffer, rank, partner, group)
            seconds = (synchronized_time(device) - started) / repeats
            if rank < partner:
                mine.append(PairResult(rank, partner, nbytes, seconds))
        dist.barrier(group=group)
    return mine


def _exchange(buffer: torch.Tensor, rank: int, partner: int, group: Any) -> None:
    """One round trip: the lower rank sends first, the higher one answers."""
    if rank < partner:
        dist.send(buffer, dst=partner, group=group)
        dist.recv(buffer, src=partner, group=group)
    else:
        dist.recv(buffer, src=partner, group=group)
        dist.send(buffer, dst=partner, group=group)
