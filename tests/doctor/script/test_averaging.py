"""averaging: the watch sees who reduced each stepped gradient (in this process, on a real model);
the rule, on hand-made facts, compares the gradients across ranks and names where the three sets
(stepped, averaged, used) part, with a healthy twin for each way to break it."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import torch
from torch import nn

from gradsync.run.check_primitives import Patches
from gradsync.run.harmless import BookkeepingByKind
from gradsync.doctor.script import registry
from gradsync.doctor.script.averaging import NAME, AveragingWatch
from gradsync.run.moments import Moments


def _watching():
    moments, patches = Moments(), Patches()
    watch = AveragingWatch(moments, BookkeepingByKind())
    watch.install(patches)
    return moments, patches, watch


def _backward(model: nn.Module) -> None:
    model(torch.ones(2, 3)).sum().backward()


def test_the_watch_tells_a_gradient_ddp_reduced_from_one_reduced_again_and_one_nobody_reduced():
    moments, patches, watch = _watching()
    try:
        model = nn.Linear(3, 1)
        built = inspect.currentframe().f_lineno + 1
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        ddp = SimpleNamespace(module=model)  # what the watch reads of a DDP model at the "wrapped" moment
        moments.models.append(ddp)
        moments.emit("wrapped", ddp, "train.py:10")
        # Step 1: DDP reduced (its count moved), then the script summed the weight's gradient again (x2).
        _backward(model)
        moments.emit("collective", "all_reduce", (model.weight.grad,), {}, "train.py:40")
        model.weight.grad.mul_(2)  # what a sum over 2 ranks of equal averages gives
        moments.reductions = 1
        moments.emit("step_starts", optimizer, 1)
        moments.emit("step_ends", optimizer, 1)
        # Step 2: DDP's count did not move (a forward that bypassed it) and nobody reduced anything.
        model.zero_grad()
        _backward(model)
        moments.emit("step_starts", optimizer, 2)
    finally:
        patches.undo()
    first, second = watch.facts()["steps"]
    assert first["ddp_reduced"] and first["twice"] == ["weight"] and first["scaled_by"] == 2
    assert first["by_hand"] == {"weight": ("train.py:40", None)} and first["unreduced"] == []
    assert not second["ddp_reduced"] and second["unreduced"] == ["weight", "bias"] and second["twice"] == []
    assert second["optimizer_built_at"].endswith(f"test_averaging.py:{built}")
    assert first["names"] == ["weight", "bias"] and all(isinstance(g, int) for g in first["grads"])


def test_a_reduction_is_matched_to_the_very_tensor_not_to_an_id_a_dead_one_left():
    moments, patches, watch = _watching()
    patches.undo()
    scratch, grad = torch.ones(3), torch.ones(3)
    moments.emit("collective", "all_reduce", (scratch,), {}, "train.py:66")
    assert watch._reduced_before(scratch) == ("train.py:66", None, 3.0)
    # A later tensor given the dead one's id (Python reuses them) was not reduced.
    watch._reduced[id(grad)] = watch._reduced.pop(id(scratch))
    assert watch._reduced_before(grad) is None


def _step(step: int, grads=(1, 2), **fields) -> dict:
    record = {"step": step, "site": "train.py:77", "names": ["w", "b"], "grads": list(grads), "ddp_reduced": True,
              "in_ddp": ["w", "b"], "by_hand": {}, "unreduced": [], "twice": [], "scaled_by": None,
              "not_stepped": [], "optimizer_built_at": "train.py:60"}
    return {**record, **fields}


def _facts(steps: list[dict], bypasses=(), sharded_at=None) -> dict:
    return {NAME: {"steps": steps, "bypasses": list(bypasses), "sharded_at": sharded_at}}


def _findings(checks: dict[int, dict]):
    return registry.findings(checks, [NAME])


def test_a_forward_that_bypassed_ddp_is_named_at_the_call():
    bypass = [{"site": "train.py:74", "step": 1}]
    checks = {r: _facts([_step(1, grads=(r, r), ddp_reduced=False, unreduced=["w", "b"])], bypass) for r in (0, 1)}
    (finding,) = _findings(checks)
    assert (finding.category, finding.ranks, finding.locations) == (
        "gradients_not_averaged", [0, 1], {"0": "train.py:74", "1": "train.py:74"})
    assert "its `.module`" in finding.message and finding.details == {"parameters": ["w", "b"], "of": 2}
    # The twin: the forward went through DDP, which averaged: the gradients agree.
    assert _findings({r: _facts([_step(1)]) for r in (0, 1)}) == []


def test_hand_written_averaging_that_left_parameters_out_is_named_at_its_loop():
    def rank(r: int) -> dict:
        return _facts([_step(1, grads=(1, 10 + r), ddp_reduced=False, in_ddp=[], unreduced=["b"],
                             by_hand={"w": ["train.py:48", "train.py:46"]})])

    (finding,) = _findings({0: rank(0), 1: rank(1)})
    assert (finding.category, finding.locations) == ("gradients_not_averaged", {"0": "train.py:46", "1": "train.py:46"})
    assert "covered 1 of the 2 parameters" in finding.message and finding.details["parameters"] == ["b"]
    # The twin: every gradient reduced by hand.
    whole = {r: _facts([_step(1, ddp_reduced=False, in_ddp=[], by_hand={"w": ["train.py:48", "train.py:46"],
                                                                       "b": ["train.py:48", "train.py:46"]})])
             for r in (0, 1)}
    assert _findings(whole) == []


def test_gradients_that_differ_although_reduced_are_not_this_checks_to_judge():
    # Reduced, yet different (a reduction over another group, a non-deterministic kernel): not "never averaged".
    checks = {r: _facts([_step(1, grads=(r, r))]) for r in (0, 1)}
    assert _findings(checks) == []


def test_a_second_reduction_is_named_where_it_changed_the_gradients():
    summed = {r: _facts([_step(1, twice=["w", "b"], scaled_by=2.0, by_hand={"w": ["train.py:42", "train.py:40"],
                                                                          "b": ["train.py:42", "train.py:40"]})])
              for r in (0, 1)}
    (finding,) = _findings(summed)
    assert (finding.category, finding.ranks, finding.locations) == (
        "gradients_averaged_twice", [0, 1], {"0": "train.py:42", "1": "train.py:42"})
    assert "scaled them by 2" in finding.message
    # A reduce to rank 0: only rank 0's gradients changed, and now differ from rank 1's.
    reduced = {0: _facts([_step(1, grads=(2, 4), twice=["w", "b"], scaled_by=2.0,
                                by_hand={"w": ["train.py:42", None], "b": ["train.py:42", None]})]),
               1: _facts([_step(1, by_hand={"w": ["train.py:42", None]})])}
    (finding,) = _findings(reduced)
    assert finding.ranks == [0] and "on rank 0: the ranks now step with different gradients" in finding.message
    # The twin: averaging the average again changes nothing (the watch records no `twice`).
    assert _findings({r: _facts([_step(1, by_hand={"w": ["train.py:42", None]})]) for r in (0, 1)}) == []


def test_parameters_no_optimizer_steps_are_named_at_fully_shard_or_at_the_optimizer():
    def steps(names, not_stepped):
        return [_step(s, names=names, grads=[1] * len(names), not_stepped=not_stepped) for s in (1, 2, 3)]

    sharded = {r: _facts(steps([], ["fc.weight", "fc.bias"]), sharded_at="train.py:78") for r in (0, 1)}
    (finding,) = _findings(sharded)
    assert (finding.category, finding.severity, finding.locations) == (
        "parameters_not_stepped", "error", {"0": "train.py:78", "1": "train.py:78"})
    assert "steps none of the parameters the forward used" in finding.message
    head = {r: _facts(steps(["w", "b"], ["head.weight"])) for r in (0, 1)}
    (finding,) = _findings(head)
    assert (finding.severity, finding.locations["0"]) == ("warning", "train.py:60")
    # At the first step only: the optimizer of a second model had not stepped yet.
    first_only = [_step(1, not_stepped=["d.weight"]), _step(2), _step(3)]
    assert _findings({r: _facts(first_only) for r in (0, 1)}) == []


def test_a_parameter_ddp_never_saw_is_named_where_it_was_created():
    def rank(r: int) -> dict:
        return _facts([_step(1, names=["w", "b", "param_groups[0][2]"], grads=(1, 2, 10 + r), in_ddp=["w", "b"],
                             unreduced=["param_groups[0][2]"], created={"param_groups[0][2]": "train.py:33"})])

    (finding,) = _findings({0: rank(0), 1: rank(1)})
    assert (finding.category, finding.locations) == ("gradients_not_averaged", {"0": "train.py:33", "1": "train.py:33"})
    assert "param_groups[0][2] was created at train.py:33" in finding.message
    # The twin: the temperature inside the wrapped model is DDP's, averaged with the rest.
    inside = {r: _facts([_step(1, names=["w", "b", "t"], grads=(1, 2, 3), in_ddp=["w", "b", "t"])]) for r in (0, 1)}
    assert _findings(inside) == []


def test_a_step_after_a_backward_under_no_sync_is_named_at_the_no_sync_call():
    def rank(r: int) -> dict:
        return _facts([_step(1), _step(2, grads=(10 + r, 20 + r), unreduced=["w", "b"], unsynced_at=["train.py:52"])])

    (finding,) = _findings({0: rank(0), 1: rank(1)})
    assert (finding.step, finding.locations) == (2, {"0": "train.py:52", "1": "train.py:52"})
    assert "its latest backward pass ran under no_sync() (entered at train.py:52)" in finding.message


def test_a_no_sync_chosen_by_a_condition_is_named_at_the_condition():
    def rank(r: int) -> dict:
        return _facts([_step(1), _step(2, grads=(10 + r, 20 + r), unreduced=["w", "b"], unsynced_at=["train.py:52"],
                                       unsynced_chosen_at=["train.py:50"])])

    (finding,) = _findings({0: rank(0), 1: rank(1)})
    assert finding.locations == {"0": "train.py:50", "1": "train.py:50"}
    assert "(entered at train.py:52, chosen by the condition at train.py:50)" in finding.message


def test_the_watch_counts_a_ddp_parameter_averaged_only_after_a_synchronising_backward():
    moments, patches, watch = _watching()
    try:
        model = nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        ddp = SimpleNamespace(module=model, require_backward_grad_sync=True)
        moments.models.append(ddp)
        moments.emit("wrapped", ddp, "train.py:10")
        for syncs, step in ((True, 1), (False, 2)):
            ddp.require_backward_grad_sync = syncs  # what no_sync() sets for the forward it wraps
            moments.emit("forward_starts", ddp, {})
            moments.emit("backward", None)
            _backward(model)
            moments.reductions += 1  # DDP's count moves for any synchronised pass since the last step
            moments.emit("step_starts", optimizer, step)
            moments.emit("step_ends", optimizer, step)
    finally:
        patches.undo()
    first, second = watch.facts()["steps"]
    assert first["unreduced"] == [] and set(second["unreduced"]) == {"weight", "bias"}


def test_replicas_a_script_averages_by_hand_and_that_started_apart_are_named_where_they_were_made():
    hand = {"w": ["train.py:48", "train.py:46"], "b": ["train.py:48", "train.py:46"]}

    def rank(r: int, start: int) -> dict:
        return _facts([_step(1, in_ddp=[], by_hand=hand, initial={"parameters": start, "created_at": "train.py:20"})])

    (finding,) = _findings({0: rank(0, 11), 1: rank(1, 12)})
    assert (finding.category, finding.locations) == ("replicas_started_apart", {"0": "train.py:20", "1": "train.py:20"})
    # The twins: the same start on every rank (a broadcast after building), or DDP, which broadcasts.
    assert _findings({r: rank(r, 11) for r in (0, 1)}) == []
    wrapped = {r: _facts([_step(1, initial={"parameters": 11 + r, "created_at": "train.py:20"})]) for r in (0, 1)}
    assert _findings(wrapped) == []
