"""gradsync's hooks keep their own failures (gradsync.run.harmless): said once per kind on the rank's
stderr, never raised into the script. The hooks' own tests are beside their modules' (test_collectives,
test_script_facts, test_worker); the last test here runs a script whose group is destroyed before a
backward pass under gradsync run, and compares it with its recorded run under plain torchrun."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gradsync.run.harmless import Bookkeeping, BookkeepingByKind, IdentityMap, exception_text
from tests.harness import REPO_ROOT
from tests.run.user_view import recorded_plain


class _Unhashable:
    """A class like some users' modules: `__eq__` without `__hash__`, so no weak dictionary keys it."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Unhashable)


def test_an_identity_map_keys_objects_by_identity_beside_them_and_forgets_the_dead():
    kept, first, second = IdentityMap(), _Unhashable(), _Unhashable()
    kept[first] = "first's"
    assert kept.get(first) == "first's" and first in kept
    assert kept.get(second) is None and second not in kept  # equal, but not the same object
    assert vars(first) == {}  # nothing on the object itself
    del first
    assert len(kept) == 0 and not kept  # dropped with its key: a new object of the same id is not it


def _fails(error: BaseException) -> None:
    raise error  # line: raised


def test_a_failure_inside_is_swallowed_and_said_once_with_the_rank_and_where(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "3")
    bookkeeping = Bookkeeping("the test's hook")
    reached = []
    for attempt in range(2):
        with bookkeeping:
            _fails(KeyError(f"group {attempt}"))
        reached.append(attempt)  # the hook goes on after the failed bookkeeping
    line = next(i for i, text in enumerate(open(__file__), 1) if text.rstrip().endswith("# line: raised"))
    assert reached == [0, 1]
    assert capsys.readouterr().err.splitlines() == [
        f"[gradsync rank 3] gradsync run: warning: the test's hook failed (KeyError: 'group 0', at test_harmless.py:{line}); "
        "it steps aside wherever it fails, and the script runs as without gradsync (said once)"
    ]
    assert bookkeeping.failure == "KeyError: 'group 0'"


@pytest.mark.parametrize("error", [KeyboardInterrupt(), SystemExit(3)], ids=["KeyboardInterrupt", "SystemExit"])
def test_an_interrupt_or_an_exit_is_not_the_hooks_to_stop(capsys, error):
    bookkeeping = Bookkeeping("the test's hook")
    with pytest.raises(type(error)):
        with bookkeeping:
            _fails(error)
    assert bookkeeping.failure is None and capsys.readouterr().err == ""


def test_a_warning_that_cannot_be_written_is_lost_not_raised(monkeypatch):
    closed = io.StringIO()
    closed.close()
    monkeypatch.setattr(sys, "stderr", closed)
    with Bookkeeping("the test's hook") as bookkeeping:
        _fails(ValueError("x"))
    assert bookkeeping.failure == "ValueError: x"


class Unprintable(Exception):
    def __str__(self) -> str:
        raise AttributeError("detail")


def test_kinds_say_each_kinds_first_failure_once(capsys):
    kinds = BookkeepingByKind()
    for hook in ("first hook", "second hook", "first hook"):
        with kinds[hook]:
            _fails(Unprintable())
    with kinds["quiet hook"]:
        pass
    assert kinds.failures() == {"first hook": "Unprintable: <exception str() failed>",
                                "second hook": "Unprintable: <exception str() failed>"}
    assert len(capsys.readouterr().err.splitlines()) == 2
    assert exception_text(Unprintable()) == "<exception str() failed>"


# -- end to end: the user's case, under plain torchrun and under gradsync run ---------------------

SCRIPT = "tests/run/zoo/destroyed_group_then_backward.py"
RUN_TIMEOUT_S = 150  # ~10-20 s on a loaded 2-core machine


def _zoo_line(tag: str) -> int:
    lines = [i for i, text in enumerate((REPO_ROOT / SCRIPT).read_text().splitlines(), 1) if text.rstrip().endswith(f"# zoo: {tag}")]
    assert len(lines) == 1
    return lines[0]


def _steps_printed(lines: list[str]) -> list[str]:
    return sorted(line for line in lines if line.startswith("step "))


@pytest.mark.launches
def test_a_script_that_destroys_its_group_before_backward_fails_where_it_fails_under_plain_torchrun(tmp_path):
    # Under plain torchrun (its recorded run, tests/run/user_view.py): the backward pass still
    # reduces over the group DDP holds, and every rank that gets there fails at its metric
    # all_reduce with the script's own ValueError.
    own_failure = ("ValueError", _zoo_line("metric_all_reduce"))
    plain = recorded_plain(Path(SCRIPT).stem, 2)
    plain_died = {(end.raised[0], int(end.raised[1].rsplit(":", 1)[1])) for end in plain.ranks.values() if end.raised}
    assert plain_died == {own_failure} and any(end.code == 1 for end in plain.ranks.values()), plain

    run_dir = tmp_path / "gradsync"
    run = subprocess.run(
        [sys.executable, "-m", "gradsync", "run", "--standalone", "--nproc-per-node", "2", "--run-dir", str(run_dir), SCRIPT],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT / "src"), "OMP_NUM_THREADS": "1"},
    )
    output = run.stdout + run.stderr
    exits = [json.loads(path.read_text())["exit"] for path in (run_dir / "workers" / "attempt0").glob("rank*.exit.json")]
    died = {(end["type"], int(end["location"].rsplit(":", 1)[1])) for end in exits if end["status"] == "exception"}
    assert run.returncode == 1 and died == {own_failure}, output[-3000:]
    assert all(end["location"].startswith(SCRIPT) for end in exits), exits
    # The first failure, as gradsync tells it: the same exception at the same line of the script.
    first = next(f for f in json.loads((run_dir / "diagnosis.json").read_text())["findings"] if f["severity"] == "error")
    assert own_failure[0] in first["message"] and first["locations"][str(first["ranks"][0])] == f"{SCRIPT}:{own_failure[1]}", first
    assert first["step"] == 3, "the backward pass that went unrecorded still counts as step 3"
    printed = _steps_printed(run.stdout.splitlines())
    assert printed == _steps_printed(plain.stdout) and len(printed) == 2, output[-3000:]
    # gradsync's own failure is said once per rank, as gradsync's, and not as the script's.
    assert sorted(re.findall(r"\[gradsync rank (\d)\] gradsync run: warning: the collective recorder's backward hook failed \(KeyError",
                             output)) == ["0", "1"], output[-3000:]
