"""The network tests: the round schedule of the pairwise test, and both tests on real Gloo ranks."""

import itertools

import pytest

from tests.harness import launch


@pytest.mark.parametrize("world_size", range(1, 10))
def test_the_circle_schedule_holds_every_pair_once_in_rounds_of_disjoint_pairs(world_size):
    from gradsync.doctor.network import circle_schedule

    rounds = circle_schedule(world_size)
    pairs = [pair for round_ in rounds for pair in round_]
    assert sorted(pairs) == list(itertools.combinations(range(world_size), 2))
    for round_ in rounds:
        busy = [rank for pair in round_ for rank in pair]
        assert len(busy) == len(set(busy)), f"a rank twice in one round: {round_}"
    assert len(rounds) == (world_size - 1 if world_size % 2 == 0 else world_size)


def _measure_network():
    import torch

    from gradsync.distributed import join_process_group, plan_distributed, shutdown
    from gradsync.doctor.network import allreduce_test, pairwise_test

    ctx = join_process_group(plan_distributed("cpu", "gloo"), timeout_s=60)
    allreduce = allreduce_test(torch.device("cpu"), "gloo")
    pairs = pairwise_test(ctx.rank, ctx.world_size, torch.device("cpu"), nbytes=1 << 20, repeats=2)
    shutdown(ctx)
    return {"allreduce": [allreduce.world_size, allreduce.small_bytes, allreduce.large_bytes, allreduce.busbw_gbps,
                          allreduce.small_s],
            "pairs": [[p.a, p.b, p.bytes, p.gbps] for p in pairs]}


@pytest.mark.launches
def test_all_reduce_and_pairwise_tests_on_three_gloo_ranks():
    results = launch(_measure_network, 3, timeout=120)
    for result in results:
        world, small, large, busbw, latency = result["allreduce"]
        assert (world, small, large) == (3, 1 << 10, 16 << 20) and busbw > 0 and 0 < latency < 1
    # Each pair is measured and reported once, by its lower rank.
    assert [sorted(p[:3] for p in r["pairs"]) for r in results] == [[[0, 1, 1 << 20], [0, 2, 1 << 20]], [[1, 2, 1 << 20]], []]
    assert all(p[3] > 0 for r in results for p in r["pairs"])
    assert len({tuple(r["allreduce"][:4]) for r in results}) == 1, "every rank reports the slowest rank's time"
