"""comm_hook_average: the watch samples what each rank hands a comm hook and what the hook's future
returned once the backward is over (in this process, with a real future); the rule, on hand-made
facts, names a hook that returns a multiple of the ranks' average at its collective, and leaves
averaging, compression, gradsync's own stand-in and buckets that cannot tell alone."""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from gradsync.doctor.script import registry
from gradsync.doctor.script.comm_hook_average import NAME, CommHookWatch
from gradsync.run.collectives import BucketReduction
from gradsync.run.harmless import BookkeepingByKind
from gradsync.run.moments import Moments


def _bucket(values: torch.Tensor, index: int = 0) -> SimpleNamespace:
    return SimpleNamespace(index=lambda: index, buffer=lambda: values)


def test_the_watch_samples_the_bucket_before_the_hook_and_its_result_after_the_backward():
    moments = Moments()
    watch = CommHookWatch(moments, BookkeepingByKind())
    buffer = torch.arange(6, dtype=torch.float32)
    reduction = BucketReduction(hook=lambda state, bucket: None, registered_at="train.py:20", own=False, group=None)
    moments.emit("bucket_reduction", _bucket(buffer), reduction)
    moments.emit("collective", "all_reduce", (buffer,), {}, "train.py:12")  # the hook's own collective
    buffer.mul_(2)  # what an in-place all_reduce of two equal ranks leaves
    future = torch.futures.Future()
    future.set_result(buffer)
    reduction.future = future
    moments.emit("bucket_reduction", _bucket(buffer), reduction)
    (entry,) = watch.facts()["reductions"]
    assert entry["output"] is None  # not read before the backward returned
    moments.emit("collective", "all_reduce", (buffer,), {}, "train.py:50")  # after the hook: not its
    moments.emit("backward_ends", True)
    assert entry["input"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] and entry["output"] == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    assert (entry["sites"], entry["registered_at"], entry["own"]) == (["train.py:12"], "train.py:20", False)



def _checks(scale, *, buckets: int = 4, own: bool = False, zero_bucket: bool = False) -> dict:
    rng = random.Random(3)
    per_rank = {rank: [[rng.gauss(0, 1) for _ in range(16)] for _ in range(buckets)] for rank in (0, 1)}
    if zero_bucket:
        per_rank[0][0] = [0.0] * 16
        per_rank[1][0] = [0.0] * 16
    checks = {}
    for rank in (0, 1):
        reductions = []
        for index in range(buckets):
            average = [(a + b) / 2 for a, b in zip(per_rank[0][index], per_rank[1][index])]
            reductions.append({"bucket": index % 2, "numel": 64, "group": [0, 1], "hook": "my_hook",
                               "hook_at": "train.py:10", "registered_at": "train.py:30", "own": own,
                               "input": per_rank[rank][index], "output": scale(average, index),
                               "sites": ["train.py:12"]})
        checks[rank] = {NAME: {"reductions": reductions}}
    return checks


def test_a_hook_that_returns_the_sum_is_named_at_its_collective():
    (finding,) = registry.findings(_checks(lambda average, _: [2 * a for a in average]), [NAME])
    assert (finding.category, finding.severity, finding.ranks) == ("comm_hook_scales_gradients", "error", [0, 1])
    assert finding.locations == {"0": "train.py:12", "1": "train.py:12"}
    assert "the sum of the ranks' gradients" in finding.message and "registered at train.py:30" in finding.message
    assert finding.details["buckets_compared"] == 4


def test_a_hook_that_divides_by_too_many_ranks_is_named_with_its_factor():
    (finding,) = registry.findings(_checks(lambda average, _: [a / 4 for a in average]), [NAME])
    assert "0.25 times the ranks' average gradient" in finding.message


def test_an_average_even_rounded_to_bf16_is_left_alone():
    rounded = lambda average, _: [float(torch.tensor(a).to(torch.bfloat16)) for a in average]  # noqa: E731
    assert registry.findings(_checks(rounded), [NAME]) == []


def test_a_compressing_hook_returns_no_multiple_of_the_average_and_is_left_alone():
    rng = random.Random(5)
    compressed = lambda average, _: [2 * a + rng.gauss(0, 0.5) for a in average]  # noqa: E731
    assert registry.findings(_checks(compressed), [NAME]) == []


def test_a_scale_that_changes_from_bucket_to_bucket_is_not_said():
    assert registry.findings(_checks(lambda average, index: [(1 + index) * a for a in average]), [NAME]) == []


def test_gradsyncs_own_stand_in_for_ddps_averaging_is_not_judged():
    assert registry.findings(_checks(lambda average, _: [2 * a for a in average], own=True), [NAME]) == []


def test_a_bucket_whose_average_is_zero_says_nothing_and_the_others_still_do():
    scaled = _checks(lambda average, _: [2 * a for a in average], zero_bucket=True)
    (finding,) = registry.findings(scaled, [NAME])
    assert finding.details["buckets_compared"] == 3
    assert registry.findings(_checks(lambda average, _: [2 * a for a in average], buckets=2, zero_bucket=True), [NAME]) == []
