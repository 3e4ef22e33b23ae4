"""What a user sees of a zoo script's run, under plain torchrun and under `gradsync run`, and where
the two may differ (the differential test of tests/run/test_zoo.py).

A user sees each rank end: its exit code, or still running when the job was stopped as hung; the
last exception its stderr shows, by type and the zoo line it came from; and what the script
printed. Both sides are read the same way, from what each launcher leaves: torchrun's per-rank
stderr files (`--redirects 2 --log-dir`) and its failure summary, `gradsync run`'s rank logs and
the agent's exit codes it kept as evidence.

The differences gradsync is allowed (`differences` names every other one) are listed in
docs/run.md, "What differs from plain torchrun".
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from gradsync.run.analysis.evidence import Evidence
from tests.run.recordings import recording

ZOO = Path(__file__).parent / "zoo"

# A rank's end: its exit code (negative: the signal that ended it), or HUNG: it was still running
# when the job was stopped as hung (by the bound under torchrun, by the stall or busy timeout under
# gradsync run).
HUNG = None
SIGTERM, SIGABRT = -signal.SIGTERM, -signal.SIGABRT
# Gloo's teardown race (../shared/README.md): a finished rank can abort in the process group's
# destructor, under either launcher.
TEARDOWN_ABORT = "terminate called without an active exception"
_TRACEBACK = "Traceback (most recent call last):"
_FRAME = re.compile(r'^  File "(?:.*/)?(tests/run/(?:doctor_)?zoo/[^"]+)", line (\d+)')
_TORCHRUN_PREFIX = re.compile(r"(?m)^\[rank\d+\]: ?")
_WARNING = re.compile(r"(?m)^(\S+\.py):(\d+): (\w+Warning): ")
_FAILURE = re.compile(r"rank\s*: (\d+) \(local_rank: \d+\)\n\s*exitcode\s*: (-?\d+)")


@dataclass(frozen=True)
class RankEnd:
    code: int | None
    raised: tuple[str, str] | None  # (exception type, 'tests/run/zoo/NAME.py:LINE'); None: no traceback
    teardown_abort: bool = False  # its stderr ends with Gloo's teardown abort
    # The Python warnings its stderr shows, by category and line ('UserWarning at NAME.py:LINE');
    # None in a recording made before they were kept.
    warned: tuple[str, ...] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"code": self.code, "raised": list(self.raised) if self.raised else None, "teardown_abort": self.teardown_abort,
                "warned": list(self.warned) if self.warned is not None else None}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankEnd:
        warned = data.get("warned")
        return cls(data["code"], tuple(data["raised"]) if data["raised"] else None, data["teardown_abort"],
                   tuple(warned) if warned is not None else None)


@dataclass(frozen=True)
class UserView:
    ranks: dict[int, RankEnd]
    # The script's lines, sorted; None where two runs under plain torchrun printed different
    # things (timings, work done in a given time), so that no run can be compared by them.
    stdout: list[str] | None = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"ranks": {str(rank): end.as_dict() for rank, end in sorted(self.ranks.items())}, "stdout": self.stdout}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> UserView:
        return cls({int(rank): RankEnd.from_dict(end) for rank, end in data["ranks"].items()}, data["stdout"])


def raised(stderr: str) -> tuple[str, str] | None:
    """(type, innermost zoo line) of the last traceback in a rank's stderr."""
    stderr = _TORCHRUN_PREFIX.sub("", stderr)
    if _TRACEBACK not in stderr:
        return None
    block = stderr[stderr.rindex(_TRACEBACK):].splitlines()[1:]
    frames = [f"{m[1]}:{m[2]}" for m in map(_FRAME.match, block) if m]
    exception = next((text for text in block if text and not text.startswith(" ")), "")
    kind = exception.split(":", 1)[0].rsplit(".", 1)[-1]
    return (kind, frames[-1]) if kind and frames else None


def warned(stderr: str) -> tuple[str, ...]:
    """The distinct Python warnings in a rank's stderr, each as 'Category at FILE:LINE' (the file's name only)."""
    return tuple(sorted({f"{m[3]} at {m[1].rsplit('/', 1)[-1]}:{m[2]}" for m in _WARNING.finditer(_TORCHRUN_PREFIX.sub("", stderr))}))


def _rank_end(code: int | None, stderr: str) -> RankEnd:
    return RankEnd(code, raised(stderr), TEARDOWN_ABORT in stderr[-2000:], warned(stderr))


def same_printed(one: list[str], other: list[str]) -> bool:
    """The same characters printed, in any order: the ranks share one console, and where two
    write at once, one rank's line can land inside the other's (under either launcher)."""
    return sorted("".join(one)) == sorted("".join(other))


def script_lines(stdout: str) -> list[str]:
    """What the script printed: gradsync's own lines (and their indented continuations) left out."""
    lines, ours = [], False
    for line in stdout.splitlines():
        ours = line.startswith("gradsync run:") or (ours and line.startswith("  "))
        if not ours:
            lines.append(line)
    return sorted(lines)


# -- plain torchrun ---------------------------------------------------------------------------------


def plain_key(name: str, nproc: int) -> tuple[str, Path, list[str]]:
    """The recording of zoo script `name`'s run under plain torchrun: its key, its script, and
    what the run depends on besides the script (torch's version, the number of ranks)."""
    return f"torchrun/{name}", ZOO / f"{name}.py", [f"torch=={torch.__version__}", "--nproc-per-node", str(nproc)]


def recorded_plain(name: str, nproc: int) -> UserView:
    """Zoo script `name`'s recorded run under plain torchrun; fails the test when it is missing or stale."""
    return UserView.from_dict(recording(*plain_key(name, nproc))["user_view"])


def torchrun_twice(script: str, nproc: int, args: list[str], cwd: Path, log_dir: Path, bound_s: float,
                   env: dict[str, str] | None = None) -> UserView:
    """`torchrun`'s view of `script`; for a run whose ranks all ended well, run once more, and its
    output kept only if the second printed the same."""
    first = torchrun(script, nproc, args, cwd, log_dir / "first", bound_s, env)
    if not all(map(_ended_well, first.ranks.values())):
        return first
    second = torchrun(script, nproc, args, cwd, log_dir / "second", bound_s, env)
    return first if same_printed(first.stdout, second.stdout) else UserView(first.ranks, None)


def torchrun(script: str, nproc: int, args: list[str], cwd: Path, log_dir: Path, bound_s: float,
             env: dict[str, str] | None = None) -> UserView:
    """Run `script` under plain torchrun, from `cwd` (with `env` added to the environment). A job
    still running after `bound_s` is taken as hung: the ranks still running then are HUNG, and
    the job is stopped."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "--redirects", "2", "--log-dir", str(log_dir), script, *args]
    launch = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    running: set[int] = set()
    try:
        stdout, stderr = launch.communicate(timeout=bound_s)
    except subprocess.TimeoutExpired:
        running = _ranks_running(launch.pid)
        _stop(launch.pid)
        stdout, stderr = launch.communicate(timeout=60)
    codes = {int(rank): int(code) for rank, code in _FAILURE.findall(stderr)}
    ends = {}
    for rank in range(nproc):
        logs = list(log_dir.glob(f"*/attempt_0/{rank}/stderr.log"))
        text = logs[0].read_text(errors="replace") if logs else ""
        ends[rank] = _rank_end(HUNG if rank in running else codes.get(rank, 0), text)
    return UserView(ends, script_lines(stdout))


def _ranks_running(pid: int) -> set[int]:
    """The ranks of torchrun's workers (its children, each with RANK set) that are running."""
    ranks = set()
    for child in psutil.Process(pid).children():
        try:
            ranks.add(int(child.environ()["RANK"]))
        except (psutil.Error, KeyError, ValueError):
            continue
    return ranks


def _stop(pid: int) -> None:
    """Stop a hung torchrun as a user would (Ctrl-C's SIGTERM to its agent, which stops its
    workers), then whatever of its tree is left."""
    tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    os.kill(pid, signal.SIGTERM)
    _, alive = psutil.wait_procs(tree, timeout=20)
    for process in alive:
        try:
            process.kill()
        except psutil.Error:
            pass


# -- gradsync run -------------------------------------------------------------------------------------


def gradsync(evidence: Evidence, logs: dict[int, str], stdout: str) -> UserView:
    """The user's view of a `gradsync run` job from the evidence of its diagnosis (the agent's exit
    codes) and its ranks' logs. A rank alive when a stall was diagnosed was stopped by gradsync as
    hung; one alive when another failed was stopped by the agent (SIGTERM)."""
    ends = {}
    for rank, view in evidence.views.items():
        if view.exitcode is not None:
            code = view.exitcode
        elif view.alive:
            code = HUNG if evidence.trigger == "stall" else SIGTERM
        else:
            code = 0
        ends[rank] = _rank_end(code, logs.get(rank, ""))
    return UserView(ends, script_lines(stdout))


# -- the comparison ----------------------------------------------------------------------------------


def differences(plain: UserView, ours: UserView) -> list[str]:
    """Where a user sees the job end otherwise under gradsync run than under plain torchrun,
    beyond the allowed differences (docs/run.md, "What differs from plain torchrun"):

    1. a job plain torchrun leaves hung, gradsync stops: its hung ranks end stopped, by gradsync
       (HUNG) or, when gradsync stopped the job as a failure, by the agent's SIGTERM;
    2. in a failed job, a rank whose peer failed dies of the failure itself (its collective's
       error, Gloo's abort) or is stopped first by the agent's SIGTERM, whichever comes first, under
       either launcher: two failing ends differ only where both show a Python exception and the
       two exceptions differ, neither rank having been stopped;
    3. a rank that finished its script and then aborted in Gloo's teardown, or was stopped while
       exiting (SIGTERM, no exception), ended as one that exited 0;
    4. what a run whose ranks all ended well printed is compared as characters in any order (the
       ranks' writes interleave on one console), and only where two runs under plain torchrun
       printed the same.

    Each rank's Python warnings (category and line) must be the same, where both runs kept them.
    """
    if set(plain.ranks) != set(ours.ranks):
        return [f"ranks {sorted(plain.ranks)} under torchrun, {sorted(ours.ranks)} under gradsync run"]
    failed = any(end.code not in (0, HUNG) for end in plain.ranks.values())
    found = [f"rank {rank}: {_said(plain.ranks[rank])} under torchrun, {_said(ours.ranks[rank])} under gradsync run"
             for rank in sorted(plain.ranks) if not _same_end(plain.ranks[rank], ours.ranks[rank], failed)]
    if all(map(_ended_well, plain.ranks.values())) and plain.stdout is not None and not same_printed(plain.stdout, ours.stdout):
        found.append(f"the script printed {plain.stdout} under torchrun, {ours.stdout} under gradsync run")
    return found


def _same_end(theirs: RankEnd, mine: RankEnd, failed: bool) -> bool:
    if None not in (theirs.warned, mine.warned) and theirs.warned != mine.warned:
        return False
    if (theirs.code, theirs.raised) == (mine.code, mine.raised):
        return True
    if theirs.code is HUNG:  # 1.
        return mine.code in (HUNG, SIGTERM)
    if failed and theirs.code not in (0, HUNG) and mine.code not in (0, HUNG):  # 2.
        return SIGTERM in (theirs.code, mine.code) or None in (theirs.raised, mine.raised) or theirs.raised == mine.raised
    return _ended_well(theirs) and _ended_well(mine)  # 3.


def _ended_well(end: RankEnd) -> bool:
    """Exited 0, or finished and then stopped or aborted in Gloo's teardown (no exception)."""
    return end.code == 0 or (end.raised is None and (end.code == SIGTERM or (end.code == SIGABRT and end.teardown_abort)))


def _said(end: RankEnd) -> str:
    code = "still running (hung)" if end.code is HUNG else f"exit {end.code}"
    return code + (f", {end.raised[0]} at {end.raised[1]}" if end.raised else "") + (f", warned {list(end.warned)}" if end.warned else "")
