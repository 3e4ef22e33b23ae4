"""Whether a job under `gradsync run` is stuck: the rank's and the monitor's judgements, as pure functions.

Two sides judge. Each rank's snapshot thread says whether the rank progressed since its last
look (`made_progress`: its stack moved, or its other threads or children worked); the launcher's
monitor says, from every rank's last progress, whether the job is stalled (`judge`), and
whether a rank whose snapshots stopped coming still works (`main_thread_worked`).

Why apart from the worker and the monitor: these decisions are made from times (CPU seconds
over an interval, when each rank last progressed, how old its snapshot is) and from which of
the launcher's processes still run. The worker and the monitor gather those (psutil, the run
folder, the clock, the job board, the process table) and apply the verdict; the rules here only
judge what they are given, so every branch and both sides of every threshold can be tested on
given readings and a given `now`, never on a loaded machine's clock or processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AbstractSet, Any, Mapping

from gradsync.run.options import RunOptions

# Work elsewhere in a rank: its other Python threads, or its child processes, together using this
# share of one core (a background save, mp.spawn's ranks, a subprocess). Idle helpers (a progress
# bar's monitor, a logger's sender, idle DataLoader workers, a stuck one) stay far below it.
BUSY_SHARE = 0.1


@dataclass(frozen=True)
class CpuReading:
    """The CPU seconds a rank's work outside its main thread had used at `time_s` (monotonic)."""

    time_s: float
    threads_s: float  # its other Python threads (not gradsync's own)
    children_s: float  # its child processes, recursively


def worked_elsewhere(before: CpuReading | None, after: CpuReading, share: float = BUSY_SHARE) -> bool:
    """Whether the rank's other threads, or its children, used at least `share` of a core
    between two readings. Nothing to compare on the first reading, nor when no time passed."""
    if before is None:
        return False
    elapsed = after.time_s - before.time_s
    return (_used_share(after.threads_s - before.threads_s, elapsed, share)
            or _used_share(after.children_s - before.children_s, elapsed, share))


def _used_share(cpu_s: float, elapsed_s: float, share: float) -> bool:
    """Whether `cpu_s` CPU seconds over `elapsed_s` are at least `share` of a core (never when no time passed)."""
    return elapsed_s > 0 and cpu_s >= share * elapsed_s


@dataclass(frozen=True)
class ThreadCpu:
    """The CPU seconds a rank's main thread had used at `time_s` (the monitor's clock), read by the
    monitor from outside the rank: it needs nothing of the rank's own threads."""

    time_s: float
    cpu_s: float


def main_thread_worked(before: ThreadCpu | None, after: ThreadCpu, share: float = BUSY_SHARE) -> bool:
    """Whether a rank's main thread used at least `share` of a core between the monitor's two
    readings. Nothing to compare on the first reading, nor when no time passed."""
    return before is not None and _used_share(after.cpu_s - before.cpu_s, after.time_s - before.time_s, share)


def made_progress(stack_changed: bool, busy_elsewhere: bool, blocked_in_collective: bool) -> bool:
    """Whether a rank progressed since its last look: its main thread's stack moved (Python work
    moves it; a wait in the backend, a deadlock or a sleep does not), or its other threads or
    children worked while its main thread was not waiting in a collective. What a collective
    waits for is the other ranks, never this rank's helpers: a busy prefetcher would otherwise
    hide the hang for as long as it runs."""
    return stack_changed or (busy_elsewhere and not blocked_in_collective)


@dataclass(frozen=True)
class StallRules:
    """The thresholds the stall rule judges by (from the run's options)."""

    stall_timeout_s: float
    snapshot_interval_s: float

    @classmethod
    def of(cls, options: RunOptions) -> "StallRules":
        return cls(options.stall_timeout_s, options.snapshot_interval_s)

    @property
    def poll_s(self) -> float:
        """How often the monitor looks at the ranks' state (and so how fresh a read it can ask for)."""
        return min(0.5, self.snapshot_interval_s)

    def snapshot_max_age_s(self, remote: bool) -> float:
        """How old the snapshot of a rank whose process cannot be checked may be while it still
        counts as running: a few missed intervals and a second of slack, plus, for a rank known
        through the job board, the up to two intervals publishing and reading add."""
        lag = 2 * self.snapshot_interval_s if remote else 0.0
        return 3 * self.snapshot_interval_s + 1 + lag


@dataclass(frozen=True)
class Observation:
    """One attempt as the monitor saw it at `now` (time.time()).

    `snapshots` and `exits`: rank -> its latest snapshot and its exit record, as read from the run
    folder and, on several nodes, the job board (another node's ranks marked "remote"). `ours`:
    the PIDs this launcher started; `running`: those of them still running (neither exited nor a
    zombie), as far as the monitor checked them; `worked_at`: of those, when the monitor last saw
    each one's main thread use CPU (`main_thread_worked`).
    """

    snapshots: Mapping[int, Mapping[str, Any]]
    exits: Mapping[int, Mapping[str, Any]]
    now: float
    ours: AbstractSet[int] = frozenset()
    running: AbstractSet[int] = frozenset()
    worked_at: Mapping[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class StallVerdict:
    """Whether to stop and diagnose the attempt as stalled, from one Observation.

    `idle_s`: how long the most recently active rank has been idle; `alive`: the ranks still
    running, in the order of the snapshots; `reason`: why stalled or not, in words.
    """

    stalled: bool
    idle_s: float
    alive: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class RemoteRead:
    """How the monitor is to read the other nodes' ranks at this poll: none older than
    `max_age_s`, and, when `until_progress`, only until one of them shows progress (that one
    rank rules the stall out, whatever the thousand others say)."""

    max_age_s: float
    until_progress: bool


def rank_alive(snapshot: Mapping[str, Any], now: float, rules: StallRules,
               ours: AbstractSet[int] = frozenset(), running: AbstractSet[int] = frozenset()) -> bool:
    """A rank this launcher started is alive while its process is; one of another node (its PID
    means nothing here) while its snapshot keeps being rewritten, in a shared run folder or
    through the job board, and its node's agent has not seen it end."""
    if snapshot["pid"] in ours and not snapshot.get("remote"):
        return snapshot["pid"] in running
    if "agent_exit" in snapshot:  # its node's agent saw it end
        return False
    return now - snapshot["time"] < rules.snapshot_max_age_s(remote=bool(snapshot.get("remote")))


def last_active(snapshot: Mapping[str, Any], exit_record: Mapping[str, Any] | None, now: float, rules: StallRules,
                ours: AbstractSet[int] = frozenset(), running: AbstractSet[int] = frozenset(),
                worked_at: Mapping[int, float] | None = None) -> float:
    """When the rank was last active: when it exited; when it was last seen, if it is gone
    without an exit record (a rank that just died means the attempt is ending, not stuck); else
    when it last made progress or, if its snapshots stopped coming, when its main thread was
    last seen working (`worked_at`: PID -> time), whichever is later.

    A snapshot older than its writer's rhythm tells nothing of the rank since: its writer thread
    was held up (seen on a loaded machine: both ranks of a healthy job silent for 8 s while DDP's
    construction imported torch._dynamo). Its main thread's CPU, read from outside, still tells
    whether the rank works; one that neither writes nor works is judged on its last progress."""
    if exit_record is not None:
        return exit_record["exit"]["time"]
    if not rank_alive(snapshot, now, rules, ours, running):
        return snapshot["time"]
    writer_silent = now - snapshot["time"] > rules.snapshot_max_age_s(remote=False)
    if writer_silent and not snapshot.get("remote") and worked_at and snapshot["pid"] in worked_at:
        return max(snapshot["last_progress"], worked_at[snapshot["pid"]])
    return snapshot["last_progress"]


def judge(seen: Observation, rules: StallRules) -> StallVerdict:
    """The stall rule: stalled when some rank still runs and none has been active for the stall
    timeout. `seen` must hold at least one snapshot."""
    now, timeout = seen.now, rules.stall_timeout_s
    idle = min(now - last_active(state, seen.exits.get(rank), now, rules, seen.ours, seen.running, seen.worked_at)
               for rank, state in seen.snapshots.items())
    alive = tuple(rank for rank, state in seen.snapshots.items()
                  if rank not in seen.exits and rank_alive(state, now, rules, seen.ours, seen.running))
    if idle < timeout:
        reason = f"a rank was active {idle:.1f} s ago, within the stall timeout ({timeout:g} s)"
    elif not alive:
        reason = f"no rank was active for {idle:.1f} s, but none is running: the attempt is ending, not stuck"
    else:
        running = ", ".join(str(rank) for rank in alive)
        reason = f"no rank was active for {idle:.1f} s (stall timeout {timeout:g} s), and rank(s) {running} still run"
    return StallVerdict(stalled=bool(alive) and idle >= timeout, idle_s=idle, alive=alive, reason=reason)


def progressing(state: Mapping[str, Any], now: float, rules: StallRules) -> bool:
    """Whether one rank's state alone rules a stall out: running, and progressing within the
    stall timeout. Asked of other nodes' ranks, whose processes cannot be checked from here."""
    return ("exit" not in state and now - state.get("last_progress", 0.0) < rules.stall_timeout_s
            and rank_alive(state, now, rules))


def remote_read(idle_s: float, rank_ended: bool, rules: StallRules) -> RemoteRead | None:
    """How fresh the other nodes' ranks must be at this poll; None: no need to read them now.

    `idle_s`: how long this node's ranks have been idle; `rank_ended`: one of them ended since
    the last poll. Once they have been idle for the stall timeout, whether the job is stuck is
    the other nodes' ranks' to say: fresh at every poll, until one shows progress. From half the
    timeout, now and then, so that something is known if the store goes. When one of this node's
    ranks just ended, at once: the attempt may be ending, and node 0's store with it.
    """
    timeout = rules.stall_timeout_s
    if rank_ended or idle_s >= timeout:
        return RemoteRead(rules.poll_s, until_progress=idle_s >= timeout)
    return RemoteRead(timeout / 4, until_progress=False) if idle_s >= timeout / 2 else None
