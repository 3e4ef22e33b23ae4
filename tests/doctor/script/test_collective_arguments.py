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


class Unnamed:
    """Where a test keeps a result without a name the watch looks at (a slot): as a call's temporary is kept."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _watching() -> tuple[Moments, ArgumentWatch, TensorWrites, Patches]:
    """The watch on a host whose state-write mode is on (patches.undo() takes it off)."""
    moments = Moments()
    watch = ArgumentWatch(moments, BookkeepingByKind())
    writes = TensorWrites(lambda write: None, Bookkeeping("the test's state-write watch"), lambda: False, lambda: False,
                          lambda: None)
    moments.tensor_writes = writes
    patches = Patches()
    writes.install(patches)
    return moments, watch, writes, patches


def test_a_result_dropped_before_any_read_is_named_and_one_read_first_is_not():
    moments, watch, writes, patches = _watching()

    def returned(op: str, result: Unnamed, site: str, *rest: torch.Tensor) -> None:
        moments.emit("collective_returned", op, (result.tensor, *rest), {}, site, None)

    try:
        counts = torch.tensor([3.0, 5.0])
        reduced = Unnamed(counts.clone())  # what torch.distributed.nn.all_reduce returns, dropped by the script
        returned("all_reduce", reduced, "train.py:31")
        del reduced.tensor
        used = Unnamed(counts.clone())
        returned("all_reduce", used, "train.py:40")
        assert used.tensor.sum().item() == 8.0
        del used.tensor
        gathered = Unnamed([torch.zeros(2), torch.zeros(2)])
        returned("all_gather", gathered, "train.py:45", counts)
        torch.cat(gathered.tensor)  # the list read whole
        del gathered.tensor
        own_slot_dropped = Unnamed([torch.zeros(2), torch.zeros(2)])
        returned("all_gather", own_slot_dropped, "train.py:46", counts)
        own_slot_dropped.tensor[0] = counts  # the local tensor keeps its gradient in its own slot
        torch.cat(own_slot_dropped.tensor)
        del own_slot_dropped.tensor
        handed = Unnamed(counts.clone())
        returned("all_reduce", handed, "train.py:47")
        writes.read_elsewhere((handed.tensor,), {})  # handed on to the next collective (the script check's collective moment)
        del handed.tensor
        token = Unnamed(torch.ones(1))  # a barrier made of an all-reduce: nobody needs its result
        returned("all_reduce", token, "train.py:50")
        del token.tensor
        returned("all_reduce", Unnamed(counts[:1]), "train.py:60")  # a view: read through counts
        alias = Unnamed(counts.data)  # another tensor holds its memory: read through counts
        returned("all_reduce", alias, "train.py:70")
        del alias.tensor
        functional = Unnamed(counts.clone())  # torch.distributed.nn.all_reduce's return value, dropped; its argument read
        moments.emit("collective_returned", "all_reduce", (counts,), {}, "train.py:75", functional.tensor)
        del functional.tensor
        logged = counts.clone()  # held by a name: read on the steps that log it, dropped unread on the others
        moments.emit("collective_returned", "all_reduce", (logged,), {}, "train.py:80", None)
        del logged
    finally:
        patches.undo()
    facts = {NAME: watch.facts()}
    assert facts[NAME]["unread"] == [{"op": "all_reduce", "site": "train.py:31", "times": 1},
                                     {"op": "all_reduce", "site": "train.py:75", "times": 1}]
    (finding,) = registry.findings({0: facts, 1: facts}, [NAME])
    assert (finding.category, finding.severity, finding.locations) == (
        "collective_result_unused", "warning", {"0": "train.py:31", "1": "train.py:31"})


def test_results_still_awaited_when_the_mode_comes_off_are_not_said_unread():
    moments, watch, writes, patches = _watching()
    reduced = Unnamed(torch.tensor([3.0, 5.0]))
    moments.emit("collective_returned", "all_reduce", (reduced.tensor,), {}, "train.py:31", None)
    writes.stop()  # the script compiles: its reads are no longer seen
    patches.undo()
    del reduced.tensor
    assert watch.facts()["unread"] == []


def test_a_loss_computed_from_the_gathered_copy_of_a_ranks_own_features_is_named_at_the_gather():
    moments, watch, writes, patches = _watching()
    anchors = torch.ones(3, 2, requires_grad=True)

    def gathered_loss(site: str, *, restore: bool = False, detached: bool = False) -> torch.Tensor:
        features = anchors * 2
        if detached:
            features = features.detach()
        gathered = [torch.zeros(3, 2), torch.zeros(3, 2)]  # slot 0 is this rank's (no process group: rank 0)
        moments.emit("collective_returned", "all_gather", (gathered, features), {}, site, None)
        if restore:
            gathered[0] = features
        return (anchors @ torch.cat(gathered).T).logsumexp(1).mean()

    try:
        moments.emit("backward", gathered_loss("train.py:40"))
        moments.emit("backward", gathered_loss("train.py:50", restore=True))  # the own slot put back: the copy is dropped
        moments.emit("backward", gathered_loss("train.py:60", detached=True))  # nothing to lose: no gradient wanted
        with torch.no_grad():
            moments.emit("backward", gathered_loss("train.py:70"))  # a gather for a metric
        differentiable = anchors * 2  # torch.distributed.nn's all_gather: its result carries the gradient
        moments.emit("collective_returned", "all_gather", ([differentiable],), {}, "train.py:80", (differentiable,))
        moments.emit("backward", differentiable.sum())
        moments.emit("backward", gathered_loss("train.py:40"))  # the same gather again: said once
    finally:
        patches.undo()
    facts = {NAME: watch.facts()}
    (entry,) = facts[NAME]["gathered_into_loss"]
    assert entry["site"] == "train.py:40" and entry["loss_site"].endswith("test_collective_arguments.py:" + str(
        next(i for i, line in enumerate(open(__file__).read().splitlines(), 1)
             if 'moments.emit("backward", gathered_loss("train.py:40"))' in line)))
    (finding,) = registry.findings({0: facts, 1: facts}, [NAME])
    assert (finding.category, finding.severity, finding.locations) == (
        "gathered_copy_in_loss", "warning", {"0": "train.py:40", "1": "train.py:40"})
    assert "dist.all_gather is not differentiable" in finding.message
