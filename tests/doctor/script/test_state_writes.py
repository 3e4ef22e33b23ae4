"""state_writes: the watch records the state going into each step and the writes beside it (in this
process, on a real model and optimizer); the rule, on hand-made facts, names what differs first and
the write that split it, and stays silent on a healthy twin of each way to break it."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import torch
from torch import nn

from gradsync.run.check_primitives import Patches
from gradsync.run.harmless import BookkeepingByKind
from gradsync.doctor.script import registry
from gradsync.run.moments import Moments
from gradsync.doctor.script.state_writes import NAME, StateWatch

HERE = "test_state_writes.py"


def _line_after() -> str:
    """'test_state_writes.py:N' of the caller's next line."""
    return f"{HERE}:{inspect.currentframe().f_back.f_lineno + 1}"


def test_the_watch_records_the_state_of_each_step_and_the_writes_beside_it():
    moments, patches = Moments(), Patches()
    original_setattr, original_load = nn.Module.__setattr__, torch.optim.Optimizer.load_state_dict
    watch = StateWatch(moments, BookkeepingByKind())
    watch.install(patches)
    try:
        model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        ddp = SimpleNamespace(module=model)  # what the watch reads of a DDP model at the "wrapped" moment
        moments.models.append(ddp)  # as the script check keeps them for every watch
        moments.ddp_parameters.update(id(p) for p in model.parameters())
        moments.emit("wrapped", ddp, "train.py:10")
        loaded = _line_after()
        optimizer.load_state_dict(optimizer.state_dict())
        replaced = _line_after()
        model[0] = nn.Linear(3, 3)  # a layer replaced after wrapping: DDP never sees its parameters
        model[1].running_mean = torch.ones(3)  # a buffer assigned anew: DDP collects buffers before each sync
        moments.emit("step_starts", optimizer, 1)
    finally:
        patches.undo()
    facts = watch.facts()
    (step,) = facts["steps"]
    assert step["step"] == 1 and "lr=0.1" in step["hyperparameters"] and "momentum=0.9" in step["hyperparameters"]
    assert isinstance(step["parameters"], int) and isinstance(step["optimizer_state"], int)
    writes = {(w["what"], w["site"].rsplit("/", 1)[-1]) for w in facts["writes"]}
    assert writes == {("Optimizer.load_state_dict", loaded), ("replaced", replaced)}, facts["writes"]
    replacement = next(w for w in facts["writes"] if w["what"] == "replaced")
    assert (replacement["kind"], replacement["target"]) == ("submodule", "0")
    assert (nn.Module.__setattr__, torch.optim.Optimizer.load_state_dict) == (original_setattr, original_load)  # undone


def _step(step: int, **parts) -> dict:
    record = {"step": step, "optimizer": 0, "site": "train.py:50", "parameters": 1, "hyperparameters": "lr=0.1",
              "optimizer_state": 7, "scalers": [], "schedulers": []}
    return {**record, **parts}


def _write(what: str, site: str, step: int = 0, effects=(1,), after_wrap: bool = True, argument=None) -> dict:
    return {"what": what, "target": "x", "site": site, "step": step, "after_wrap": after_wrap, "effects": list(effects),
            "argument": argument}


def _facts(steps: list[dict], writes: list[dict]) -> dict:
    return {NAME: {"steps": steps, "writes": writes}}


def _findings(checks: dict[int, dict]):
    return registry.findings(checks, [NAME])


def test_an_optimizer_state_loaded_on_rank0_only_is_named_at_the_load():
    load = _write("Optimizer.load_state_dict", "train.py:83", after_wrap=False)
    checks = {0: _facts([_step(1, hyperparameters="lr=0.0002", optimizer_state=9)], [load]),
              1: _facts([_step(1)], [])}
    (finding,) = _findings(checks)
    assert (finding.category, finding.ranks, finding.locations, finding.step) == (
        "state_written_on_some_ranks", [0], {"0": "train.py:83"}, 1)
    assert finding.details == {"differs": ["hyperparameters", "optimizer_state"], "write": "Optimizer.load_state_dict"}
    assert "(lr: rank 0 0.0002, rank 1 0.1)" in finding.message and "before the first step" in finding.message
    # The healthy twin: every rank loads the same state (sent by broadcast_object_list).
    same = {r: _facts([_step(1, hyperparameters="lr=0.0002", optimizer_state=9)], [load]) for r in (0, 1)}
    assert _findings(same) == []


def test_weights_loaded_on_rank0_after_wrapping_part_the_parameters_before_the_first_step():
    load = _write("Module.load_state_dict", "train.py:76")
    checks = {0: _facts([_step(1, parameters=5)], [load]), 1: _facts([_step(1)], [])}
    (finding,) = _findings(checks)
    assert (finding.ranks, finding.locations, finding.details["differs"]) == ([0], {"0": "train.py:76"}, ["parameters"])
    assert "between DDP's construction and the first step" in finding.message
    # Loaded on rank 0 before wrapping: DDP's broadcast made the parameters equal, nothing differs.
    before = _write("Module.load_state_dict", "train.py:70", after_wrap=False)
    assert _findings({0: _facts([_step(1)], [before]), 1: _facts([_step(1)], [])}) == []


def test_a_scheduler_stepped_with_each_ranks_own_metric_is_named_with_what_it_was_given():
    def plateau(effect: int, value: str) -> list[dict]:
        return [_write("scheduler.step", "train.py:86", step=s, effects=[1 if s < 2 else effect], argument=value)
                for s in (1, 2)]

    rank0 = _facts([_step(1), _step(2), _step(3, schedulers=[4], hyperparameters="lr=0.05")], plateau(4, "5.51"))
    rank1 = _facts([_step(1), _step(2), _step(3, schedulers=[8])], plateau(8, "5.05"))
    (finding,) = _findings({0: rank0, 1: rank1})
    assert (finding.ranks, finding.step, finding.locations) == ([0, 1], 3, {"0": "train.py:86", "1": "train.py:86"})
    assert "after step 2" in finding.message and "rank 0 5.51, rank 1 5.05" in finding.message
    # The twin: the metric all-reduced first, so the scheduler leaves the same state everywhere.
    same = {r: _facts([_step(1), _step(2), _step(3, schedulers=[4])], plateau(4, "5.3")) for r in (0, 1)}
    assert _findings(same) == []


def test_a_difference_no_write_explains_is_left_to_update_differs():
    checks = {0: _facts([_step(1, hyperparameters="lr=0.05")], []), 1: _facts([_step(1)], [])}
    assert _findings(checks) == []


def test_a_layer_replaced_after_wrapping_is_named_at_the_assignment():
    replaced = {"what": "replaced", "kind": "submodule", "target": "attn.proj", "site": "model.py:51", "step": 0,
                "after_wrap": True, "in_forward": False, "times": 1, "effects": []}
    checks = {r: _facts([_step(1)], [replaced]) for r in (0, 1)}
    (finding,) = _findings(checks)
    assert (finding.category, finding.ranks, finding.locations) == (
        "replaced_after_wrapping", [0, 1], {"0": "model.py:51", "1": "model.py:51"})
    assert "The submodule 'attn.proj'" in finding.message and "never averaged" in finding.message
    assert _findings({r: _facts([_step(1)], []) for r in (0, 1)}) == []


def test_the_write_explains_the_divergence_and_the_update_it_caused():
    load = _write("Module.load_state_dict", "train.py:76")
    checks = {0: _facts([_step(1, parameters=5)], [load]), 1: _facts([_step(1)], [])}
    models = [{"site": "train.py:60", "parameters": {"w": 1}, "buffers": {}, "buffers_synced": True}]
    for rank, facts in checks.items():
        facts.update(steps=4, models=[{**models[0], "parameters": {"w": rank}}])
    found = registry.findings(checks, [NAME, "replicas"])
    assert [f.category for f in found] == ["state_written_on_some_ranks"]
    assert [f.category for f in registry.findings(checks, ["replicas"])] == ["parameters_diverged"]


class Unhashable(nn.Module):
    """A module class that defines __eq__ and so, in Python, has no __hash__."""

    def __eq__(self, other):
        return self is other

    __hash__ = None


def test_an_unhashable_module_sets_its_attributes_as_without_the_watch():
    moments, patches = Moments(), Patches()
    watch = StateWatch(moments, BookkeepingByKind())
    watch.install(patches)
    try:
        ddp = SimpleNamespace(module=nn.Linear(2, 2))
        moments.models.append(ddp)
        moments.emit("wrapped", ddp, "train.py:10")
        module = Unhashable()  # its __init__ sets attributes through the patched __setattr__
        module.inner = nn.Linear(2, 2)
    finally:
        patches.undo()
    assert isinstance(module.inner, nn.Linear) and watch.facts()["writes"] == []


# -- writes read at the tensor level, compared rank by rank (differential execution) --------------


def _tensor_write(op: str, site: str, kinds=("parameter",), scalars=(), count: int = 1) -> dict:
    return {"op": op, "site": site, "kinds": list(kinds), "names": ["fc.weight"], "scalars": [list(scalars)] if scalars else [],
            "count": count, "in_forward": False}


def _with_tensor_writes(steps: list[dict], windows: dict[int, list[dict]]) -> dict:
    return {NAME: {"steps": steps, "writes": [], "tensor_writes": {str(w): ws for w, ws in windows.items()}}}


def test_a_parameter_written_in_place_on_one_rank_is_named_at_that_line():
    every = _tensor_write("grad =", "train.py:40", kinds=("gradient",))
    checks = {0: _with_tensor_writes([_step(1), _step(2), _step(3, parameters=5)],
                                     {1: [every], 2: [every, _tensor_write("mul_", "train.py:44", scalars=("0.5",))]}),
              1: _with_tensor_writes([_step(1), _step(2), _step(3)], {1: [every], 2: [every]})}
    (finding,) = _findings(checks)
    assert (finding.category, finding.ranks, finding.locations, finding.step) == (
        "state_written_on_some_ranks", [0], {"0": "train.py:44"}, 3)
    assert "rank 0 ran `mul_` on the parameter fc.weight at train.py:44 after step 2, and rank 1 did not" in finding.message


def test_a_gradient_scaled_by_a_number_of_each_ranks_own_is_named_with_the_numbers():
    def divided(count: str) -> dict:
        return _tensor_write("div_", "train.py:47", kinds=("gradient",), scalars=(count,))

    checks = {0: _with_tensor_writes([_step(1, gradients=11)], {0: [divided("32")]}),
              1: _with_tensor_writes([_step(1, gradients=12)], {0: [divided("17")]}),
              2: _with_tensor_writes([_step(1, gradients=11)], {0: [divided("32")]})}
    (finding,) = _findings(checks)
    assert (finding.ranks, finding.locations, finding.details["how"]) == ([1], {"1": "train.py:47"}, "numbers")
    assert "with numbers of its own (rank 0 32, rank 1 17, rank 2 32)" in finding.message


def test_a_layer_frozen_on_some_ranks_is_named_at_the_flip():
    flip = _tensor_write("requires_grad =", "train.py:61", scalars=("False",), count=2)
    checks = {0: _with_tensor_writes([_step(1), _step(2, trainable=3)], {1: [flip]}),
              1: _with_tensor_writes([_step(1), _step(2, trainable=4)], {1: []})}
    (finding,) = _findings(checks)
    assert (finding.ranks, finding.locations, finding.details["differs"]) == ([0], {"0": "train.py:61"}, ["trainable"])


def test_writes_every_rank_makes_alike_are_not_blamed():
    alike = [_tensor_write("grad =", "train.py:40", kinds=("gradient",)),
             _tensor_write("mul_", "train.py:44", kinds=("gradient",), scalars=("0.25",))]
    healthy = {rank: _with_tensor_writes([_step(1), _step(2)], {0: alike, 1: alike}) for rank in (0, 1)}
    assert _findings(healthy) == []
    # ... and when the state parts for another reason, the writes every rank made alike are not its cause
    parted = {0: _with_tensor_writes([_step(1), _step(2, parameters=9)], {0: alike, 1: alike}),
              1: _with_tensor_writes([_step(1), _step(2)], {0: alike, 1: alike})}
    assert all(f.details.get("write") != "mul_" for f in _findings(parted))


# -- the modules run beside the wrapped model (gradsync.run.companions) ----------------------------

TEACHER = "Teacher called at train.py:30"


def _companion_write(op: str, site: str, loop_site: str | None, results=(), count: int = 1) -> dict:
    return {**_tensor_write(op, site, kinds=("companion",), count=count), "names": [f"{TEACHER}: fc.weight"],
            "loop_site": loop_site, "results": list(results)}


def _with_companions(fingerprints: list[list[int | None]], windows: dict[int, list[dict]], created: str | None = None) -> dict:
    steps = [_step(step, companions={TEACHER: pair}) for step, pair in enumerate(fingerprints, 1)]
    facts = _with_tensor_writes(steps, windows)
    facts[NAME]["companions"] = {TEACHER: {"created": created, "names": ["fc.weight", "fc.bias"]}}
    return facts


def test_a_companion_updated_on_one_rank_only_is_named_at_the_loop_line_it_was_updated_under():
    update = _companion_write("lerp_", "train.py:20", loop_site="train.py:61")
    checks = {0: _with_companions([[1, None], [2, None]], {1: [update]}),
              1: _with_companions([[1, None], [1, None]], {1: []})}
    (finding,) = _findings(checks)
    assert (finding.category, finding.ranks, finding.locations, finding.step) == ("companion_apart", [0], {"0": "train.py:61"}, 2)
    assert "rank 0 ran `lerp_` on it at train.py:61 (the write itself at train.py:20) after step 1, and rank 1 did not" in finding.message
    assert "alike going into step 1" in finding.message


def test_a_companion_made_apart_is_named_where_its_parameters_were_made():
    # its EMA update every step leaves each rank's copy its own too: a consequence, not the cause
    checks = {rank: _with_companions([[10 + rank, None], [20 + rank, None]],
                                     {1: [_companion_write("mul_", "train.py:20", "train.py:64", results=[30 + rank])]},
                                     created="train.py:29") for rank in (0, 1)}
    (finding,) = _findings(checks)
    assert (finding.ranks, finding.locations, finding.step) == ([0, 1], {"0": "train.py:29", "1": "train.py:29"}, 1)
    assert "its parameters were made at train.py:29 with different values on each rank" in finding.message


def test_a_companion_updated_from_each_ranks_own_batch_is_named_at_the_update():
    # its first writes came before it was first called (not yet known); the next window's show the update
    checks = {rank: _with_companions([[None, 10 + rank], [None, 20 + rank]],
                                     {1: [_companion_write("copy_", "norm.py:30", "train.py:47", results=[40 + rank])]})
              for rank in (0, 1)}
    (finding,) = _findings(checks)
    assert (finding.ranks, finding.locations, finding.details["differs"]) == (
        [0, 1], {"0": "train.py:47", "1": "train.py:47"}, ["buffers"])
    assert "every rank ran `copy_` on it at train.py:47 (the write itself at norm.py:30) after step 1" in finding.message


def test_a_companion_no_write_explains_is_named_at_its_call():
    checks = {rank: _with_companions([[1, 5], [1, 6 + rank]], {}) for rank in (0, 1)}
    (finding,) = _findings(checks)
    assert finding.locations == {"0": "train.py:30", "1": "train.py:30"} and "inside its own call" in finding.message


def test_companions_alike_or_on_one_rank_only_are_not_blamed():
    alike = {rank: _with_companions([[1, 2], [3, 4]], {1: [_companion_write("mul_", "train.py:20", "train.py:64", results=[9])]})
             for rank in (0, 1)}
    assert _findings(alike) == []
    rank0_only = {0: _with_companions([[1, 2], [3, 4]], {}), 1: _with_tensor_writes([_step(1), _step(2)], {})}
    assert _findings(rank0_only) == []
