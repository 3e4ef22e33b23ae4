"""collective_arguments: the watch reads the tensors a collective is handed (in this process); the rule,
on what ranks record, names an output list that holds one tensor twice and dtypes that differ by rank,
and leaves distinct outputs and torch's in-place forms alone."""

from __future__ import annotations

import torch

from gradsync.doctor.script import registry
from gradsync.doctor.script.collective_arguments import NAME, ArgumentWatch
from gradsync.run.harmless import BookkeepingByKind
from gradsync.run.moments import Moments


def _recorded(*calls) -> dict:
    moments = Moments()
    watch = ArgumentWatch(moments, BookkeepingByKind())
    for op, args in calls:
        moments.emit("collective", op, args, {}, "train.py:20")
    return {NAME: watch.facts()}


def test_an_output_list_holding_one_tensor_twice_is_named_at_the_call():
    features = torch.ones(4, 2)
    shared = torch.zeros(4, 2)
    facts = _recorded(("all_gather", ([shared] * 2, features)))
    (finding,) = registry.findings({0: facts, 1: facts}, [NAME])
    assert (finding.category, finding.locations) == ("collective_output_aliased", {"0": "train.py:20", "1": "train.py:20"})
    assert "positions 0 and 1" in finding.message


def test_distinct_outputs_and_an_input_in_its_own_slot_are_left_alone():
    features = torch.ones(4, 2)
    gathered = torch.zeros(8, 2)
    # Without a process group the own slot is rank 0's: the input is the first chunk of the output.
    healthy = _recorded(("all_gather", ([torch.zeros(4, 2) for _ in range(2)], features)),
                        ("all_gather", (list(gathered.chunk(2)), gathered.chunk(2)[0])))
    assert registry.findings({0: healthy, 1: healthy}, [NAME]) == []


def test_an_input_over_another_ranks_slot_is_named():
    gathered = torch.zeros(8, 2)
    facts = _recorded(("all_gather", (list(gathered.chunk(2)), gathered.chunk(2)[1])))
    (finding,) = registry.findings({0: facts, 1: facts}, [NAME])
    assert finding.details["overlaps"] == 1 and "another rank's slot" in finding.message


def test_tensors_of_another_dtype_on_one_rank_are_named():
    checks = {0: _recorded(("all_reduce", (torch.ones(1, dtype=torch.int32),))),
              1: _recorded(("all_reduce", (torch.zeros(1),)))}
    (finding,) = registry.findings(checks, [NAME])
    assert finding.category == "collective_dtypes_differ" and "rank 0 int32; rank 1 float32" in finding.message
    alike = {rank: _recorded(("all_reduce", (torch.zeros(1),))) for rank in (0, 1)}
    assert registry.findings(alike, [NAME]) == []
