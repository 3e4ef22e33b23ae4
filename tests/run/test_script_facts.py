"""The script check's watches (--doctor-steps) inside pytest's own process: whatever they cannot
read, the script's own calls return and raise as without them. (The facts they gather, compared
across real ranks, are tested in test_doctor_script.py and test_doctor_consistency.py.)"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data.distributed import DistributedSampler

from gradsync.doctor import script as script_check
from gradsync.run.collectives import CollectiveRecorder, install
from gradsync.run.script_facts import ScriptCheck
from tests.run.side_by_side import gloo_world, gradsync_warnings, outcome


@contextlib.contextmanager
def _checked(tmp_path: Path) -> Iterator[ScriptCheck]:
    """The recorder and the script check as the worker installs them for --doctor-steps
    (gradsync.run.worker), on a Gloo group of their own, taken off again afterwards."""
    recorder = CollectiveRecorder()
    uninstall = install(recorder, record_buckets=True)
    check = ScriptCheck(recorder, 1000, tmp_path / "facts.json", on_last_step=lambda: None, probe=script_check)
    undo = check.install()
    try:
        with gloo_world(tmp_path / "checked"):
            yield check
    finally:
        undo()
        uninstall()
        torch.autograd.set_detect_anomaly(False)  # the check traces the first graph of a DDP model


def _with_and_without_check(scenario: Callable[[], Any], tmp_path: Path) -> tuple[tuple, tuple, ScriptCheck]:
    """The scenario as a plain script, then under the script check, each on a Gloo group of its own."""
    with gloo_world(tmp_path / "plain"):
        plain = outcome(scenario)
    with _checked(tmp_path) as check:
        checked = outcome(scenario)
    return plain, checked, check


def _failed_watches(check: ScriptCheck, err: str) -> set[str]:
    """The watches that said they failed, once each, as the facts report them too."""
    warnings = gradsync_warnings(err)
    failed = {line.split("warning: ", 1)[1].split(" failed (", 1)[0] for line in warnings}
    assert len(failed) == len(warnings), "one warning per kind of watch"
    check.write()
    assert set(json.loads(check.path.read_text())["watch_failures"]) == failed
    return failed


class Stream(IterableDataset):
    """A stream that says it has no length up front, as some libraries' streams do."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(torch.arange(6.0).split(2))

    def __len__(self) -> int:
        raise NotImplementedError("a stream has no length")


class ListLoader(DataLoader):
    """A DataLoader whose iterator is a plain list's (which cannot be weakly referenced)."""

    def _get_iterator(self) -> Iterator[Any]:
        return iter(list(super()._get_iterator()))


@pytest.mark.parametrize("make_loader", [lambda: DataLoader(Stream(), batch_size=None),
                                         lambda: ListLoader(torch.arange(6.0), batch_size=2)], ids=["no_length", "list_iterator"])
def test_a_dataloader_the_watch_cannot_read_yields_the_same_batches(tmp_path, capsys, make_loader):
    def two_passes():
        loader = make_loader()
        return [[batch.tolist() for batch in loader] for _ in range(2)]

    plain, checked, check = _with_and_without_check(two_passes, tmp_path)
    assert checked == plain and plain[0] == "returned", (plain, checked)
    assert _failed_watches(check, capsys.readouterr().err) == {"the script check's DataLoader watch"}


class ComparableSampler(DistributedSampler):
    """A sampler that compares by its settings: defining __eq__ leaves it unhashable."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ComparableSampler) and vars(self) == vars(other)


def test_an_unhashable_sampler_draws_the_same_indices(tmp_path, capsys):
    def draw():
        sampler = ComparableSampler(range(10), num_replicas=2, rank=1, shuffle=True, seed=3)
        sampler.set_epoch(1)
        return list(sampler), [batch.tolist() for batch in DataLoader(range(10), sampler=sampler, batch_size=2)]

    plain, checked, check = _with_and_without_check(draw, tmp_path)
    assert checked == plain and plain[0] == "returned", (plain, checked)
    # The host's watch and sampler_overlap's (which keeps each sampler's line) each say their own failure.
    assert _failed_watches(check, capsys.readouterr().err) == {"the script check's DistributedSampler watch",
                                                                 "the script check's DataLoader watch",
                                                                 "the sampler_overlap check's watch"}


class Head(torch.nn.Module):
    """A module that compares by value: defining __eq__ leaves it unhashable."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Head) and torch.equal(self.linear.weight, other.linear.weight)


def test_an_unhashable_module_switches_to_eval_and_back_as_without_the_watch(tmp_path, capsys):
    def switch():
        head = Head()
        returned = head.eval()
        evaluating = (head.training, head.linear.training)
        head.train()
        return returned is head, evaluating, (head.training, head.linear.training)

    plain, checked, check = _with_and_without_check(switch, tmp_path)
    assert checked == plain == ("returned", (True, (False, False), (True, True))), (plain, checked)
    assert _failed_watches(check, capsys.readouterr().err) == {"the eval_mode check's watch"}


class UnmountedPath:
    """A path-like whose file system is gone: reading it as a path fails."""

    def __fspath__(self) -> str:
        raise FileNotFoundError("the share behind this path is not mounted")


def test_open_raises_the_scripts_own_error_when_the_write_watch_cannot_read_the_path(tmp_path, capsys):
    plain, checked, check = _with_and_without_check(lambda: open(UnmountedPath(), "w"), tmp_path)  # noqa: SIM115
    assert checked == plain and plain[:2] == ("raised", "FileNotFoundError"), (plain, checked)
    assert _failed_watches(check, capsys.readouterr().err) == {"the same_file check's watch"}


class LazyBatch(Mapping):
    """A batch whose fields are read on demand and that cannot list them (its index is remote)."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.x

    def __iter__(self) -> Iterator[str]:
        raise OSError("the batch index is on a store that is not mounted")

    def __len__(self) -> int:
        return 1


class ReadsBatches(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 2)

    def forward(self, batch: Mapping) -> torch.Tensor:
        return self.linear(batch["x"])


def test_a_training_forward_whose_inputs_cannot_be_fingerprinted_trains_as_without_the_watch(tmp_path, capsys):
    def train():
        torch.manual_seed(0)
        model = DistributedDataParallel(ReadsBatches())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            model(LazyBatch(torch.ones(4, 3))).pow(2).mean().backward()
            optimizer.step()
        return [p.tolist() for p in model.parameters()]

    plain, checked, check = _with_and_without_check(train, tmp_path)
    assert checked == plain and plain[0] == "returned", (plain, checked)
    assert _failed_watches(check, capsys.readouterr().err) == {"the script check's DDP watch"}
    assert check.steps == 2, "the steps the check stops after are still counted"


def test_uninstalling_the_check_puts_back_what_it_replaced():
    import builtins

    def watched():
        return (builtins.open, torch.manual_seed, torch.autograd.backward, DataLoader.__iter__, torch.nn.Module.train,
                DistributedSampler.__iter__, DistributedDataParallel.forward, vars(torch.nn.Parameter)["__new__"],
                torch.compile)

    before, modes = watched(), len(torch.overrides._get_current_function_mode_stack())
    undo = ScriptCheck(CollectiveRecorder(), 1, Path(os.devnull), on_last_step=lambda: None, probe=script_check).install()
    assert all(now is not then for now, then in zip(watched(), before))
    assert len(torch.overrides._get_current_function_mode_stack()) == modes + 1  # the state-write watch's mode
    undo()
    assert watched() == before and len(torch.overrides._get_current_function_mode_stack()) == modes


def test_each_parameter_is_noted_where_the_script_made_it(tmp_path):
    with _checked(tmp_path) as check:
        temperature = torch.nn.Parameter(torch.ones(1))  # line: made
        layer = torch.nn.Linear(2, 2)  # line: layer
    made = next(i for i, text in enumerate(open(__file__), 1) if text.rstrip().endswith("# line: made"))
    assert check.moments.created_at(temperature) == f"tests/run/test_script_facts.py:{made}"
    assert check.moments.created_at(layer.weight) == f"tests/run/test_script_facts.py:{made + 1}"


def test_only_the_distributed_trainings_steps_are_counted(tmp_path):
    """A rank-local optimization (rank 0 fitting a model of its own before training) is not one of
    the K steps: counted, it made that rank stop early, inside a collective its peers were still in."""
    import torch.distributed as dist

    def steps() -> list[int]:
        counts = []
        local = torch.nn.Linear(2, 1)
        local_optimizer = torch.optim.SGD(local.parameters(), lr=0.1)
        for _ in range(3):  # no wrapper, no collective: local work
            local(torch.ones(1, 2)).sum().backward()
            local_optimizer.step()
        counts.append(check.steps)
        ddp = DistributedDataParallel(torch.nn.Linear(2, 1))
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        ddp(torch.ones(1, 2)).sum().backward()
        optimizer.step()  # steps a DDP model's parameters
        counts.append(check.steps)
        local(torch.ones(1, 2)).sum().backward()
        for parameter in local.parameters():
            dist.all_reduce(parameter.grad)  # averaged by hand: a distributed step
        local_optimizer.step()
        counts.append(check.steps)
        return counts

    with _checked(tmp_path) as check:
        counted = steps()
    assert counted == [0, 1, 2]


def test_the_collective_moment_is_patched_only_when_a_selected_check_listens(tmp_path):
    import torch.distributed as dist

    recorder = CollectiveRecorder()
    uninstall = install(recorder, record_buckets=True)
    recorded = dist.all_reduce
    try:
        for checks, patched in ((["same_file"], False), (["averaging"], True)):
            undo = ScriptCheck(recorder, 1000, tmp_path / "facts.json", lambda: None, script_check, checks=checks).install()
            try:
                assert (dist.all_reduce is not recorded) == patched, checks
            finally:
                undo()
    finally:
        uninstall()
        torch.autograd.set_detect_anomaly(False)


def test_a_collective_called_wrongly_fails_with_torchs_own_error(tmp_path):
    import torch.distributed as dist

    def wrong_call():
        dist.all_reduce()  # no tensor

    plain, checked, _ = _with_and_without_check(wrong_call, tmp_path)
    assert checked == plain and plain[:2] == ("raised", "TypeError"), (plain, checked)
