"""collective_arguments: the watch reads the tensors a collective is handed, and awaits the first read
of what it wrote (in this process); the rule, on what ranks record, names an output list that holds
one tensor twice, dtypes that differ by rank and a result dropped unread, and leaves distinct
outputs, torch's in-place forms, results read and barrier tokens alone."""

from __future__ import annotations

import torch

from gradsync.doctor.script import registry
from gradsync.doctor.script.collective_arguments import NAME, ArgumentWatch
from gradsync.run.check_primitives import Patches
from gradsync.run.harmless import Bookkeeping, BookkeepingByKind
from gradsync.run.moments import Moments
from gradsync.run.tensor_writes import TensorWrites


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


def test_a_result_dropped_before_any_read_is_named_and_one_read_first_is_not():
    moments = Moments()
    watch = ArgumentWatch(moments, BookkeepingByKind())
    writes = TensorWrites(lambda write: None, Bookkeeping("the test's state-write watch"), lambda: False, lambda: False,
                          lambda: None)
    moments.tensor_writes = writes
    patches = Patches()
    writes.install(patches)
    try:
        counts = torch.tensor([3.0, 5.0])
        reduced = counts.clone()  # what torch.distributed.nn.all_reduce returns, dropped by the script
        moments.emit("collective_returned", "all_reduce", (reduced,), {}, "train.py:31")
        del reduced
        used = counts.clone()
        moments.emit("collective_returned", "all_reduce", (used,), {}, "train.py:40")
        assert used.sum().item() == 8.0
        del used
        gathered = [torch.zeros(2), torch.zeros(2)]
        moments.emit("collective_returned", "all_gather", (gathered, counts), {}, "train.py:45")
        torch.cat(gathered)  # the list read whole
        del gathered
        own_slot_dropped = [torch.zeros(2), torch.zeros(2)]
        moments.emit("collective_returned", "all_gather", (own_slot_dropped, counts), {}, "train.py:46")
        own_slot_dropped[0] = counts  # the local tensor keeps its gradient in its own slot
        torch.cat(own_slot_dropped)
        del own_slot_dropped
        handed = counts.clone()
        moments.emit("collective_returned", "all_reduce", (handed,), {}, "train.py:47")
        writes.read_elsewhere((handed,), {})  # handed on to the next collective (the script check's collective moment)
        del handed
        token = torch.ones(1)  # a barrier made of an all-reduce: nobody needs its result
        moments.emit("collective_returned", "all_reduce", (token,), {}, "train.py:50")
        del token
        moments.emit("collective_returned", "all_reduce", (counts[:1],), {}, "train.py:60")  # a view: read through counts
        alias = counts.data  # another tensor holds its memory: read through counts
        moments.emit("collective_returned", "all_reduce", (alias,), {}, "train.py:70")
        del alias
    finally:
        patches.undo()
    facts = {NAME: watch.facts()}
    assert facts[NAME]["unread"] == [{"op": "all_reduce", "site": "train.py:31", "times": 1}]
    (finding,) = registry.findings({0: facts, 1: facts}, [NAME])
    assert (finding.category, finding.severity, finding.locations) == (
        "collective_result_unused", "warning", {"0": "train.py:31", "1": "train.py:31"})


def test_results_still_awaited_when_the_mode_comes_off_are_not_said_unread():
    moments = Moments()
    watch = ArgumentWatch(moments, BookkeepingByKind())
    writes = TensorWrites(lambda write: None, Bookkeeping("the test's state-write watch"), lambda: False, lambda: False,
                          lambda: None)
    moments.tensor_writes = writes
    patches = Patches()
    writes.install(patches)
    reduced = torch.tensor([3.0, 5.0])
    moments.emit("collective_returned", "all_reduce", (reduced,), {}, "train.py:31")
    writes.stop()  # the script compiles: its reads are no longer seen
    patches.undo()
    del reduced
    assert watch.facts()["unread"] == []
