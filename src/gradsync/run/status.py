"""A running job seen from outside it: every rank's state now (`gradsync status`) and every
thread's stack on demand (`gradsync stacks`), across every node.

Nothing new runs in the workers for this: under `gradsync run` each rank already writes its
state once a second (where it is, whether it waits in a collective, its optimizer steps and
recent step time, its process tree's CPU and its memory), and each node's launcher publishes
its ranks' states to the rendezvous store (gradsync.run.jobwide). So the status of the ranks of
this node comes from the run folder, and of the other nodes from the store, as the job-wide
diagnosis reads them. After the job, the same files hold each rank's last state and how it
ended, marked as such.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import psutil

from gradsync.errors import ConfigError
from gradsync.run.analysis.views import RankView, read_from_outside_text
from gradsync.run.analysis.working import holding_text
from gradsync.run.analysis.wording import describe
from gradsync.run.jobwide import JobBoard, StoreAddress, round_of, world_size_of
from gradsync.run.outside import with_outside_read
from gradsync.run.stall import IDLE, WORKING
from gradsync.run.stacks import StacksRequest
from gradsync.rundir import RunDir, read_attempt, read_json
from gradsync.rundir.layout import RUNS_ROOT

SLOWEST_SHARE = 0.05  # waits that differ by less than this share of the run name no slowest rank
STALE_AFTER_S = 5.0  # a live rank rewrites its state every second at most: older than this, it is not heard of
BOARD_INTERVAL_S = 1.0


def newest_run(root: Path = RUNS_ROOT) -> Path:
    """The run folder of `gradsync run` under `root` whose workers wrote last."""
    runs = [folder for folder in (root.iterdir() if root.is_dir() else ()) if RunDir(folder).workers.is_dir()]
    if not runs:
        raise ConfigError(f"no run of `gradsync run` under {root}/: give the run folder (its --run-dir), "
                          "e.g. `gradsync status gradsync_runs/20261206-101500`.")
    return max(runs, key=lambda folder: RunDir(folder).workers.stat().st_mtime)


@dataclass
class JobState:
    """Every rank's latest state (its exit record once it ended) of the run's latest attempt."""

    run_dir: Path
    attempt: int
    states: dict[int, dict[str, Any]]
    now: float
    diagnosis: dict[str, Any] | None = None
    board: JobBoard | None = field(default=None, repr=False)

    @property
    def ended(self) -> bool:
        """No rank is alive any more: each ended (an exit record), or none was heard of lately and the launcher's verdict is written."""
        if all("exit" in s for s in self.states.values()):
            return True
        fresh = any(self.now - float(s.get("time") or 0) < STALE_AFTER_S for s in self.states.values() if "exit" not in s)
        return not fresh and self.diagnosis is not None


def read_job(run_dir: str | Path, board: JobBoard | None = None, now: Callable[[], float] = time.time,
             read_silent: bool = False) -> JobState:
    """The job's ranks as they are: this node's from the run folder, the other nodes' from the
    job board (through the rendezvous store, when the launcher left its address in the folder).
    `read_silent`: a rank of this host whose reports stopped is read from outside (py-spy, up to a
    second each: for `gradsync status`, not for the polls of a stacks request)."""
    run = RunDir(Path(run_dir))
    attempt = run.latest_attempt()
    if attempt is None:
        raise ConfigError(f"{run.root}: no worker of `gradsync run` has started there yet (no workers/ folder).")
    snapshots, exits = read_attempt(run, attempt)
    if board is None:
        address = StoreAddress.read(run.job_board)
        board = JobBoard(address, BOARD_INTERVAL_S) if address is not None else None
    states = {**snapshots, **exits}
    if board is not None and states:
        remote = board.read(round_of(attempt, states), world_size_of(states), set(states), max_age_s=0.0)
        states = {**remote, **states}
    diagnosis = read_json(run.diagnosis)
    seen = now()
    if read_silent:
        states = {rank: _read_if_silent(state, seen) for rank, state in states.items()}
    return JobState(run.root, attempt, dict(sorted(states.items())), seen, diagnosis if isinstance(diagnosis, dict) else None, board)


def _read_if_silent(state: dict[str, Any], now: float) -> dict[str, Any]:
    """A rank of this host whose reports stopped while its process runs (its main thread holds the
    GIL in a native call, or it is stopped) read from outside, as the launcher reads it at a stall
    (gradsync.run.outside); any other rank as it reported itself."""
    silent_s = now - float(state.get("time") or now)
    if ("exit" in state or state.get("remote") or silent_s < STALE_AFTER_S or state.get("host") != socket.gethostname()
            or not isinstance(state.get("pid"), int) or not psutil.pid_exists(state["pid"])):
        return state
    return with_outside_read(state, silent_s, WORKING, IDLE)


# -- one line per rank --------------------------------------------------------------------------


@dataclass(frozen=True)
class RankStatus:
    """What `gradsync status` shows of one rank."""

    rank: int
    host: str
    pid: int | None
    state: str  # "waiting in all_reduce #57 at train.py:42 for 3 s", "working at train.py:30", "ended: finished"
    waiting_in: tuple[str, int | None] | None  # (group, seq) of the collective it waits in
    step: int | None
    step_time_s: float | None
    cpu_percent: float | None
    rss_mb: float | None
    since_progress_s: float | None
    communication_wait_s: float | None  # the training thread's waits for communication so far
    running_s: float | None  # since the rank started


def rank_status(rank: int, state: dict[str, Any], now: float) -> RankStatus:
    view = RankView(rank, snapshot=state, exit=state.get("exit"))
    activity = state.get("activity") or {}
    waiting_in = None
    ended = state.get("exit")
    if ended is not None:
        if ended.get("status") == "exception":
            text = f"ended: failed with {ended.get('type')} at {ended.get('location') or view.location or '?'}"
        elif ended.get("status") == "exit_code":
            text = f"ended: exit code {ended.get('code')}"
        else:
            text = "ended: finished"
    elif view.held_at_exit is not None:
        text = f"script ended, exit held: {holding_text(view)}"
    elif now - float(state.get("time") or 0) >= STALE_AFTER_S:
        text = (f"not heard of for {now - float(state.get('time') or 0):.0f} s; "
                + ("read from outside: at " if state.get("outside_read") else "last at ")
                + (view.location or "?") + read_from_outside_text(view))
    else:
        waiting = view.waiting_on()
        if waiting is not None:
            waiting_in = (waiting.get("group") or "default", waiting.get("seq"))
            since = waiting.get("entered")
            text = (f"waiting in {describe(waiting)} at {waiting.get('site') or '?'}"
                    + (f" for {now - since:.0f} s" if isinstance(since, (int, float)) else ""))
        else:
            text = f"{activity.get('state') or 'running'} at {view.location or '?'}"
    share = activity.get("cpu_share")
    progress = state.get("last_progress")
    return RankStatus(
        rank=rank,
        host=str(state.get("host") or "?"),
        pid=state.get("pid"),
        state=text,
        waiting_in=waiting_in,
        step=state.get("optimizer_steps"),
        step_time_s=state.get("step_time_s"),
        cpu_percent=None if share is None else max(0.0, 100 * share),
        rss_mb=state.get("rss_mb"),
        since_progress_s=None if ended is not None or not isinstance(progress, (int, float)) else max(0.0, now - progress),
        communication_wait_s=state.get("communication_wait_s"),
        running_s=None if not isinstance(state.get("started"), (int, float)) else float(state["time"]) - state["started"],
    )


def job_line(job: JobState, ranks: list[RankStatus]) -> str:
    """The line above the ranks: running or ended, the slowest rank, and who waits for whom."""
    if job.ended:
        verdict = (job.diagnosis or {}).get("status")
        head = f"job ended ({'last known state' + (f'; diagnosis: {verdict}' if verdict else '')})"
    else:
        head = f"job running: {len(ranks)} ranks, attempt {job.attempt}"
    parts = [head]
    # Ranks of one data-parallel job step together, so their step times match: the slowest is
    # the one that waited least for the others, when the waits differ by more than SLOWEST_SHARE
    # of the time the ranks ran.
    waited = [r for r in ranks if r.communication_wait_s is not None and r.running_s]
    if len(waited) > 1:
        slowest = min(waited, key=lambda r: r.communication_wait_s or 0.0)
        most = max(waited, key=lambda r: r.communication_wait_s or 0.0)
        if (most.communication_wait_s or 0.0) - (slowest.communication_wait_s or 0.0) > SLOWEST_SHARE * (most.running_s or 0.0):
            parts.append(f"slowest rank {slowest.rank} (it waited {slowest.communication_wait_s:.1f} s for the others, "
                         f"rank {most.rank} {most.communication_wait_s:.1f} s)")
    waiting: dict[tuple[str, int | None], list[int]] = {}
    for r in ranks:
        if r.waiting_in is not None:
            waiting.setdefault(r.waiting_in, []).append(r.rank)
    if waiting and not job.ended:
        # The collective most ranks wait in; the ranks not in it are the ones waited for.
        (group, seq), waiters = max(waiting.items(), key=lambda item: len(item[1]))
        others = [r for r in ranks if r.rank not in waiters and not r.state.startswith("ended")]
        where = f"collective #{seq}" if seq is not None else "a collective"
        if group != "default":
            where += f" on {group}"
        if others:
            parts.append(f"{_ranks(waiters)} {_wait(waiters)} in {where} for {_ranks([r.rank for r in others])} "
                         f"({'; '.join(f'rank {r.rank} {r.state}' for r in others[:3])})")
        else:
            parts.append(f"{_ranks(waiters)} {_wait(waiters)} in {where}")
    return " | ".join(parts)


def _wait(ranks: list[int]) -> str:
    return "waits" if len(ranks) == 1 else "wait"


def _ranks(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    shown = ", ".join(str(r) for r in ranks[:8]) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
    return ("rank " if len(ranks) == 1 else "ranks ") + shown


def statuses(job: JobState) -> list[RankStatus]:
    return [rank_status(rank, state, job.now) for rank, state in job.states.items()]


def status_lines(job: JobState) -> list[str]:
    """The job line, then one plain line per rank (what `gradsync status` prints without --watch)."""
    ranks = statuses(job)
    lines = [job_line(job, ranks)]
    for r in ranks:
        fields = [
            f"rank {r.rank}", f"{r.host} pid {r.pid or '?'}", r.state,
            f"step {'-' if r.step is None else r.step}",
            f"{'-' if r.step_time_s is None else f'{r.step_time_s:.3g}'} s/step",
            f"CPU {'-' if r.cpu_percent is None else f'{r.cpu_percent:.0f}%'}",
            f"RSS {'-' if r.rss_mb is None else f'{r.rss_mb:,.0f} MB'}",
            "progress " + ("-" if r.since_progress_s is None else f"{r.since_progress_s:.0f} s ago"),
        ]
        lines.append("  " + " | ".join(fields))
    return lines


# -- stacks on demand ---------------------------------------------------------------------------


def request_stacks(run_dir: str | Path, wait_s: float = 4.0, board: JobBoard | None = None,
                   poll_s: float = 0.2) -> tuple[JobState, dict[int, list[dict[str, Any]]]]:
    """Ask every rank of the job for its threads' stacks and wait up to `wait_s` for the answers:
    rank -> its threads. A rank that ended answers with its exit record's threads; one that does
    not answer in time is left out (the caller says so)."""
    run = RunDir(Path(run_dir))
    request = StacksRequest.new()
    request.write(run.stacks_request)
    job = read_job(run.root, board)
    if job.board is not None:
        job.board.request_stacks(request.id)
    deadline = time.monotonic() + wait_s
    while True:
        answers = {rank: s["threads"] for rank, s in job.states.items()
                   if s.get("threads") and (s.get("stacks_id") == request.id or "exit" in s)}
        if len(answers) == len(job.states) or time.monotonic() >= deadline:
            return job, answers
        time.sleep(poll_s)
        job = read_job(run.root, job.board)
