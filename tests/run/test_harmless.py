"""gradsync's hooks keep their own failures (gradsync.run.harmless): said once per kind on the rank's
stderr, never raised into the script. The hooks' own tests are beside their modules' (test_collectives,
test_script_facts, test_worker); the last test here runs a script whose group is destroyed before a
backward pass under both launchers."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys

import pytest

from gradsync.run.harmless import Bookkeeping, BookkeepingByKind, exception_text
from tests.harness import REPO_ROOT


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
RUN_TIMEOUT_S = 150  # each launch; ~10-20 s on a loaded 2-core machine


def _zoo_line(tag: str) -> int:
    lines = [i for i, text in enumerate((REPO_ROOT / SCRIPT).read_text().splitlines(), 1) if text.rstrip().endswith(f"# zoo: {tag}")]
    assert len(lines) == 1
    return lines[0]


def _died_with(stderr: str) -> tuple[str, int | None] | None:
    """(exception type, the script's innermost line) of the last traceback in a rank's stderr; None
    without one (a rank torchrun stopped before it raised)."""
    stderr = re.sub(r"(?m)^\[rank\d+\]: ?", "", stderr)  # torchrun's prefix on its workers' lines
    if "Traceback (most recent call last):" not in stderr:
        return None
    block = stderr[stderr.rindex("Traceback (most recent call last):"):].splitlines()[1:]
    lines = [int(m[1]) for m in (re.search(r'File ".*destroyed_group_then_backward\.py", line (\d+)', text) for text in block) if m]
    exception = next(text for text in block if text and not text.startswith(" "))
    return exception.split(":", 1)[0].rsplit(".", 1)[-1], (lines[-1] if lines else None)


def _launch(launcher: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *launcher, "--standalone", "--nproc-per-node", "2", SCRIPT],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT / "src"), "OMP_NUM_THREADS": "1"},
    )


def _steps_printed(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("step ")]


@pytest.mark.launches
def test_a_script_that_destroys_its_group_before_backward_fails_where_it_fails_under_plain_torchrun(tmp_path):
    # Measured under plain torchrun: the backward pass still reduces over the group DDP holds, and
    # every rank that gets there fails at its metric all_reduce with the script's own ValueError.
    own_failure = ("ValueError", _zoo_line("metric_all_reduce"))
    logs = tmp_path / "torchrun"
    plain = _launch(["torch.distributed.run", "--log-dir", str(logs), "--redirects", "2"])
    plain_died = {int(path.parent.name): _died_with(path.read_text()) for path in logs.glob("*/attempt_0/*/stderr.log")}
    assert plain.returncode != 0 and set(plain_died.values()) - {None} == {own_failure}, plain.stderr[-3000:]
    plain_first = int(re.search(r"Root Cause \(first observed failure\):.*?rank\s*: (\d+)", plain.stderr, re.DOTALL)[1])

    run_dir = tmp_path / "gradsync"
    run = _launch(["gradsync", "run", "--run-dir", str(run_dir)])
    output = run.stdout + run.stderr
    exits = [json.loads(path.read_text())["exit"] for path in (run_dir / "workers" / "attempt0").glob("rank*.exit.json")]
    died = {(end["type"], int(end["location"].rsplit(":", 1)[1])) for end in exits if end["status"] == "exception"}
    assert run.returncode == plain.returncode and died == {own_failure}, output[-3000:]
    assert all(end["location"].startswith(SCRIPT) for end in exits), exits
    # The first failure, as each launcher tells it: the same exception at the same line of the script.
    first = next(f for f in json.loads((run_dir / "diagnosis.json").read_text())["findings"] if f["severity"] == "error")
    assert plain_died[plain_first] == own_failure
    assert own_failure[0] in first["message"] and first["locations"][str(first["ranks"][0])] == f"{SCRIPT}:{own_failure[1]}", first
    assert first["step"] == 3, "the backward pass that went unrecorded still counts as step 3"
    assert _steps_printed(run.stdout) == _steps_printed(plain.stdout) and len(_steps_printed(plain.stdout)) == 2, output[-3000:]
    # gradsync's own failure is said once per rank, as gradsync's, and not as the script's.
    assert sorted(re.findall(r"\[gradsync rank (\d)\] gradsync run: warning: the collective recorder's backward hook failed \(KeyError",
                             output)) == ["0", "1"], output[-3000:]
