"""Every path of a run folder, named once, and the one rule that chooses the folder."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

RUNS_ROOT = Path("gradsync_runs")

# Per-rank file names, "{}" standing for the global rank (`by_rank` finds them again).
SNAPSHOT = "rank{}.json"
EXIT_RECORD = "rank{}.exit.json"
RING = "rank{}.ring"
LOG = "rank{}.log"
SYSTEM = "system-rank{}.jsonl"
FAULT = "fault-rank{}.json"
FATAL = "fatal-rank{}.txt"
FATAL_OF_LOADER_WORKERS = "fatal-rank{}-loader-workers.txt"
SCRIPT_CHECK = "script-check-rank{}.json"
FLIGHT = "flight-rank{}.json"
PROFILE_TRACE = "rank{}.trace.json"
PROFILE_BREAKDOWN = "rank{}.breakdown.json"


@dataclass(frozen=True)
class RunDir:
    """A run folder: the files in it, by what they hold (see `gradsync.rundir` for who writes
    and who reads each one)."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    # -- the run -------------------------------------------------------------------------------

    @property
    def metrics(self) -> Path:
        """One JSON row per optimizer step, written by the trainer's rank 0 (MetricsRow)."""
        return self.root / "metrics.jsonl"

    @property
    def description(self) -> Path:
        """What the trainer ran with (world size, backend, strategy, precision, compression,
        accumulation) and when it started and ended, written by its rank 0 (RunDescription)."""
        return self.root / "run.json"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def profile(self) -> Path:
        """torch.profiler traces and step-time breakdowns, one pair per rank."""
        return self.root / "profile"

    def profile_trace(self, rank: int) -> Path:
        return self.profile / PROFILE_TRACE.format(rank)

    def profile_breakdown(self, rank: int) -> Path:
        return self.profile / PROFILE_BREAKDOWN.format(rank)

    @property
    def diagnosis(self) -> Path:
        """gradsync run's diagnosis of the job (the latest attempt's until the job ends)."""
        return self.root / "diagnosis.json"

    @property
    def second_pass(self) -> Path:
        """`gradsync doctor`'s second run, which traces one step window line by line: a run folder of its own."""
        return self.root / "second-pass"

    @property
    def options(self) -> Path:
        """gradsync run's own options, read by every worker (RunOptions)."""
        return self.root / "run_options.json"

    @property
    def launcher_log(self) -> Path:
        """What torchrun's agent logged about starting, stopping and restarting the workers."""
        return self.root / "launcher.log"

    @property
    def report(self) -> Path:
        return self.root / "report.html"

    @property
    def stacks_request(self) -> Path:
        """The latest `gradsync stacks` request, read by every worker's snapshot thread (StacksRequest)."""
        return self.root / "stacks-request.json"

    @property
    def job_board(self) -> Path:
        """Where this node's launcher reaches the other nodes' ranks: the rendezvous store's
        address and the job's id, for `gradsync status` and `gradsync stacks` (absent for a one-node job)."""
        return self.root / "job-board.json"

    @property
    def previous(self) -> Path:
        """Where an earlier launch's records go when the folder is launched in again."""
        return self.root / "previous"

    # -- the workers of one attempt ------------------------------------------------------------

    @property
    def workers(self) -> Path:
        return self.root / "workers"

    def attempt(self, attempt: int) -> Path:
        """One restart attempt's files: a restarted group never mixes with the one it replaces."""
        return self.workers / f"attempt{attempt}"

    def snapshot(self, attempt: int, rank: int) -> Path:
        """The rank's state, rewritten every second (Snapshot)."""
        return self.attempt(attempt) / SNAPSHOT.format(rank)

    def exit_record(self, attempt: int, rank: int) -> Path:
        """How the rank's script ended (ExitRecord)."""
        return self.attempt(attempt) / EXIT_RECORD.format(rank)

    def ring(self, attempt: int, rank: int) -> Path:
        """The rank's last collectives, one fixed-size slot each (RingRecord)."""
        return self.attempt(attempt) / RING.format(rank)

    def log(self, attempt: int, rank: int) -> Path:
        """Everything the rank printed, its backend libraries' log lines and its traceback."""
        return self.attempt(attempt) / LOG.format(rank)

    def system(self, attempt: int, rank: int) -> Path:
        """One JSON line of machine readings and progress counters per snapshot (SystemReading)."""
        return self.attempt(attempt) / SYSTEM.format(rank)

    def fault(self, attempt: int, rank: int) -> Path:
        """The record an injected fault leaves just before it fires (FaultRecord)."""
        return self.attempt(attempt) / FAULT.format(rank)

    def fatal(self, attempt: int, rank: int) -> Path:
        """Every thread's Python stack at a fatal signal (SIGSEGV, SIGABRT...), as faulthandler
        writes it; empty when the rank ended otherwise."""
        return self.attempt(attempt) / FATAL.format(rank)

    def fatal_of_loader_workers(self, attempt: int, rank: int) -> Path:
        """faulthandler's dumps of the rank's DataLoader worker processes at a fatal signal, appended."""
        return self.attempt(attempt) / FATAL_OF_LOADER_WORKERS.format(rank)

    def script_check(self, attempt: int, rank: int) -> Path:
        """What a rank saw of its own run under --doctor-steps."""
        return self.attempt(attempt) / SCRIPT_CHECK.format(rank)

    def flight(self, attempt: int, rank: int) -> Path:
        """The rank's Flight Recorder entries, compact, when it was quiet for a while or exited (FlightDump)."""
        return self.attempt(attempt) / FLIGHT.format(rank)

    def flight_raw(self, attempt: int) -> Path:
        """torch's own Flight Recorder dumps, one `rank_R` per rank, for torch's fr_trace analyser."""
        return self.attempt(attempt) / "flight"

    def attempt_diagnosis(self, attempt: int) -> Path:
        """Each attempt's own diagnosis; `diagnosis` is the latest one."""
        return self.attempt(attempt) / "diagnosis.json"

    def attempt_evidence(self, attempt: int) -> Path:
        """What the attempt's diagnosis was made from (gradsync.run.analysis.evidence), to make it again."""
        return self.attempt(attempt) / "evidence.json"

    def ranks_with(self, attempt: int, pattern: str) -> dict[int, Path]:
        """rank -> path of the attempt's files named like `pattern` (SNAPSHOT, FAULT, ...)."""
        return by_rank(self.attempt(attempt), pattern)

    def profile_breakdowns(self) -> dict[int, Path]:
        return by_rank(self.profile, PROFILE_BREAKDOWN)

    def latest_attempt(self) -> int | None:
        attempts = [int(p.name[7:]) for p in self.workers.glob("attempt*") if p.name[7:].isdigit()]
        return max(attempts) if attempts else None

    def archive_previous_launch(self) -> Path | None:
        """Move an earlier launch's worker files, diagnosis and launcher log out of the way (into
        previous/<time>/), so a relaunch in the same folder, such as a resumed job, is never
        diagnosed from the old launch's records. Returns where they went."""
        records = [path for path in (self.workers, self.diagnosis, self.launcher_log) if path.exists()]
        if not records:
            return None
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(records[0].stat().st_mtime))
        archive = self.previous / stamp
        n = 1
        while archive.exists():
            n += 1
            archive = archive.with_name(f"{stamp}-{n}")
        archive.mkdir(parents=True)
        for path in records:
            with contextlib.suppress(FileNotFoundError):  # another node's launcher moved it first
                path.rename(archive / path.name)
        return archive


def by_rank(folder: Path, pattern: str) -> dict[int, Path]:
    """rank -> path of the files in `folder` named like `pattern`, "{}" standing for the rank."""
    prefix, suffix = pattern.split("{}")
    found = {}
    for path in folder.glob(f"{prefix}*{suffix}"):
        middle = path.name[len(prefix) : len(path.name) - len(suffix)]
        if middle.isdigit():
            found[int(middle)] = path
    return dict(sorted(found.items()))


# -- choosing the folder: once per run ----------------------------------------------------------

_inherited: Path | None = None


def inherit(root: Path) -> None:
    """Under `gradsync run`, the worker says which folder the launcher chose, before the script
    runs: a trainer in that script then writes its metrics next to the diagnosis."""
    global _inherited
    _inherited = Path(root).absolute()


def inherited() -> Path | None:
    return _inherited


def choose(explicit: str | Path | None, prefix: str = "") -> tuple[Path, str | None]:
    """The run's folder and, when an explicit one is overruled, the line that says so.

    The launcher's choice wins under `gradsync run` (one run, one folder); otherwise the folder
    given, else a new one under gradsync_runs/.
    """
    if _inherited is not None:
        if explicit is not None and Path(explicit).absolute() != _inherited:
            return _inherited, (
                f"run_dir={str(explicit)!r} is not used: gradsync run chose {_inherited} for this run (its --run-dir), "
                "where the diagnosis, the ranks' logs and the metrics belong together"
            )
        return _inherited, None
    if explicit is not None:
        return Path(explicit), None
    return fresh(prefix), None


def fresh(prefix: str = "") -> Path:
    """A folder name not used yet: gradsync_runs/<prefix><timestamp>[-N]."""
    base = RUNS_ROOT / f"{prefix}{time.strftime('%Y%m%d-%H%M%S')}"
    candidate, n = base, 1
    while candidate.exists():
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate
