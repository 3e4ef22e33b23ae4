"""Whether a job under `gradsync run` is stuck or kept busy: the rank's and the monitor's judgements, as pure functions.

Two sides judge. Each rank's snapshot thread classifies the rank at each look into one of three
states (`rank_state`): *waiting* in a collective, *working* (CPU time advancing anywhere in its
process tree, or its Python position moving), or *idle* outside collectives (a sleep, a lock, a
read that never returns, a queue nothing fills). The launcher's monitor keeps two clocks from every
rank's last real progress (a collective entered or finished, an optimizer step, an exit) and last
work (`judge`): the *stall* clock stops a job in which no rank was active for the stall timeout;
the *busy* clock, while ranks wait in a collective for a rank that keeps working without real
progress, prints a note at the stall timeout and stops the job only at the busy timeout. A job in
which no rank was active for the stall timeout but none waits in a collective either (nobody waits
on a peer: each rank waits on something of its own, its DataLoader's workers opening their shards,
a lock, a subprocess) is not a communication hang: it goes on the busy clock too. A rank
whose snapshots stopped coming is judged by its main thread's CPU as read from outside
(`main_thread_worked`).

Why apart from the worker and the monitor: these decisions are made from times (CPU seconds
over an interval, when each rank last progressed or worked, how old its snapshot is) and from
which of the launcher's processes still run. The worker and the monitor gather those (psutil,
/proc, the run folder, the clock, the job board, the process table) and apply the verdict; the
rules here only judge what they are given, so every branch and both sides of every threshold can
be tested on given readings and a given `now`, never on a loaded machine's clock or processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AbstractSet, Any, Mapping

from gradsync.run.options import DEFAULT_BUSY_TIMEOUT_S, RunOptions

# Work in a rank's process tree: its threads (gradsync's own left out) and all its descendant
# processes together using this share of one core between two looks (a native call, a busy
# DataLoader worker, a subprocess). An idle rank (a sleep, a lock, a thread polling an event now
# and then, idle DataLoader workers) stays far below it.
BUSY_SHARE = 0.1
OPEN_RECORDS = 16  # a rank's latest recorded collectives looked at for one still open

WAITING, WORKING, IDLE = "waiting", "working", "idle"


@dataclass(frozen=True)
class CpuReading:
    """The CPU seconds a rank had used at `time_s` (monotonic): `tree_s` by its process (less
    gradsync's own threads) and all its descendants, reaped ones included; `main_s` by its main
    thread alone."""

    time_s: float
    tree_s: float
    main_s: float


def tree_worked(before: CpuReading | None, after: CpuReading, share: float = BUSY_SHARE) -> bool:
    """Whether the rank's process tree used at least `share` of a core between two readings.
    Nothing to compare on the first reading, nor when no time passed."""
    return before is not None and _used_share(after.tree_s - before.tree_s, after.time_s - before.time_s, share)


def in_native_call(before: CpuReading | None, after: CpuReading, same_instruction: bool, share: float = BUSY_SHARE) -> bool:
    """Whether the main thread sits inside one native call: it used at least `share` of a core
    while its innermost Python frame stayed at the same instruction (`same_instruction`). A Python
    loop, even on one line, moves the instruction between looks; a C call (an eigensolver, an SVD)
    does not."""
    return (same_instruction and before is not None
            and _used_share(after.main_s - before.main_s, after.time_s - before.time_s, share))


def rank_state(blocked_in_collective: bool, worked: bool, position_moved: bool) -> str:
    """The rank's state at one look, each backed by evidence.

    WAITING: blocked in a collective with its Python position still; what it waits for is the
    other ranks, so CPU burnt meanwhile (a busy prefetcher, NCCL's proxy threads, CUDA's
    spin-waits) is not work. WORKING: its process tree used CPU (`worked`), or its Python position
    moved (Python work around a collective call, like DDP's construction importing modules; a loop
    that mostly waits on the network). IDLE: neither: a sleep, a lock, a read that never
    returns, a queue nothing fills.
    """
    if blocked_in_collective and not position_moved:
        return WAITING
    return WORKING if worked or position_moved else IDLE


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


@dataclass(frozen=True)
class StallRules:
    """The thresholds the stall and busy rules judge by (from the run's options)."""

    stall_timeout_s: float
    snapshot_interval_s: float
    busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S

    @classmethod
    def of(cls, options: RunOptions) -> "StallRules":
        return cls(options.stall_timeout_s, options.snapshot_interval_s, options.busy_timeout_s)

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
    each one's main thread use CPU (`main_thread_worked`), for a rank whose snapshots stopped.
    """

    snapshots: Mapping[int, Mapping[str, Any]]
    exits: Mapping[int, Mapping[str, Any]]
    now: float
    ours: AbstractSet[int] = frozenset()
    running: AbstractSet[int] = frozenset()
    worked_at: Mapping[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Busy:
    """Ranks wait in a collective while others keep working without real progress.

    `for_s`: since the job's last real progress (a collective entered or finished, an optimizer
    step, an exit) on any rank; `working`: the ranks outside any collective that work now
    (`works_now`); `waiting`: the ranks whose latest look found them waiting in one; `stop`: the
    busy timeout is reached.
    """

    for_s: float
    working: tuple[int, ...]
    waiting: tuple[int, ...]
    stop: bool
    # The ranks still running when none of them waits in a collective: nobody waits on a peer, so no
    # communication hang; each waits on something of its own (its DataLoader's workers, a lock).
    outside: tuple[int, ...] = ()


@dataclass(frozen=True)
class StallVerdict:
    """Whether to stop and diagnose the attempt as stalled, or note it as kept busy, from one Observation.

    `idle_s`: how long the most recently active rank has been idle (neither progressing nor
    working); `progress_idle_s`: since the most recent real progress of any rank; `alive`: the
    ranks still running, in the order of the snapshots; `busy`: set when no rank progressed for
    the stall timeout but one works while others wait for it (never together with `stalled`);
    `reason`: why stalled, busy or neither, in words.
    """

    stalled: bool
    idle_s: float
    alive: tuple[int, ...]
    reason: str
    progress_idle_s: float = 0.0
    busy: Busy | None = None


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


def last_progressed(snapshot: Mapping[str, Any], exit_record: Mapping[str, Any] | None, now: float, rules: StallRules,
                    ours: AbstractSet[int] = frozenset(), running: AbstractSet[int] = frozenset()) -> float:
    """When the rank last made real progress: when it exited; when it was last seen, if it is
    gone without an exit record (a rank that just died means the attempt is ending, not stuck);
    else its last collective entered or finished, or optimizer step (`last_progress`)."""
    if exit_record is not None:
        return exit_record["exit"]["time"]
    if not rank_alive(snapshot, now, rules, ours, running):
        return snapshot["time"]
    return snapshot["last_progress"]


def activity_of(snapshot: Mapping[str, Any]) -> Mapping[str, Any]:
    """The rank's latest look as its snapshot carries it (empty before its first look)."""
    return snapshot.get("activity") or {}


def seen_working_at(snapshot: Mapping[str, Any]) -> float:
    """When the rank's own looks last found it working (0 when never, or before it said)."""
    return float(activity_of(snapshot).get("worked_at") or 0.0)


def _worked_at_from_outside(snapshot: Mapping[str, Any], now: float, rules: StallRules,
                            worked_at: Mapping[int, float] | None) -> float | None:
    """When the monitor last saw the main thread of this node's rank use CPU, if the rank's
    snapshots stopped coming (its writer thread held up); None while they come, or unknown."""
    writer_silent = now - snapshot["time"] > rules.snapshot_max_age_s(remote=False)
    if writer_silent and not snapshot.get("remote") and worked_at and snapshot["pid"] in worked_at:
        return worked_at[snapshot["pid"]]
    return None


def last_active(snapshot: Mapping[str, Any], exit_record: Mapping[str, Any] | None, now: float, rules: StallRules,
                ours: AbstractSet[int] = frozenset(), running: AbstractSet[int] = frozenset(),
                worked_at: Mapping[int, float] | None = None) -> float:
    """When the rank was last active: its last real progress (`last_progressed`) or, while it
    runs, when it was last seen working: by its own looks, or, if its snapshots stopped coming,
    by its main thread's CPU read from outside (`worked_at`: PID -> time), whichever is latest.

    A snapshot older than its writer's rhythm tells nothing of the rank since: its writer thread
    was held up (seen on a loaded machine: both ranks of a healthy job silent for 8 s while DDP's
    construction imported torch._dynamo; a native call that holds the GIL does it too). Its main
    thread's CPU, read from outside, still tells whether the rank works; one that neither writes
    nor works is judged on its last progress and work."""
    progressed = last_progressed(snapshot, exit_record, now, rules, ours, running)
    if exit_record is not None or not rank_alive(snapshot, now, rules, ours, running):
        return progressed
    active = max(progressed, seen_working_at(snapshot))
    outside = _worked_at_from_outside(snapshot, now, rules, worked_at)
    return active if outside is None else max(active, outside)


def waits_in_collective(snapshot: Mapping[str, Any]) -> bool:
    """Whether the rank's latest look found it waiting in a collective (rank_state), or its records
    hold a collective it entered or issued and never saw finish: the main thread waiting at the end
    of a backward for DDP's bucket reductions sits in native code without CPU, and its looks say idle."""
    if activity_of(snapshot).get("state") == WAITING:
        return True
    return any(record.get("state") in ("entered", "issued") for record in (snapshot.get("records") or [])[-OPEN_RECORDS:])


def works_now(snapshot: Mapping[str, Any], now: float, rules: StallRules, worked_at: Mapping[int, float] | None = None) -> bool:
    """Whether the rank's latest look found it working or, its snapshots having stopped coming,
    the monitor saw its main thread use CPU since. A rank that worked until a moment ago and now
    sleeps is not working: the stall clock, not the busy one, is its."""
    outside = _worked_at_from_outside(snapshot, now, rules, worked_at)
    if outside is not None:
        return outside > snapshot["time"]
    return activity_of(snapshot).get("state") == WORKING


def judge(seen: Observation, rules: StallRules) -> StallVerdict:
    """The two clocks. Stalled: some rank still runs and none has been active (progressing or
    working) for the stall timeout. Busy: not stalled, no rank made real progress for the stall
    timeout, and ranks wait in a collective while others work; it is to be stopped once that
    lasted the busy timeout. `seen` must hold at least one snapshot."""
    now, timeout = seen.now, rules.stall_timeout_s
    ranks = seen.snapshots.items()
    idle = min(now - last_active(state, seen.exits.get(rank), now, rules, seen.ours, seen.running, seen.worked_at)
               for rank, state in ranks)
    progress_idle = min(now - last_progressed(state, seen.exits.get(rank), now, rules, seen.ours, seen.running)
                        for rank, state in ranks)
    alive = tuple(rank for rank, state in ranks
                  if rank not in seen.exits and rank_alive(state, now, rules, seen.ours, seen.running))
    waiting = tuple(rank for rank in alive if waits_in_collective(seen.snapshots[rank]))
    # Idle for the stall timeout with no rank in a collective: nobody waits on a peer. Not stopped
    # at the stall timeout (a DataLoader whose workers open their shards for minutes), only at the
    # busy timeout, like a rank that keeps working while others wait.
    # Only where every running rank's looks said what it was doing: a state of an older gradsync
    # (or a rank never looked at) may be a wait in a collective.
    looked = all(activity_of(seen.snapshots[rank]).get("state") for rank in alive)
    outside = bool(alive) and idle >= timeout and looked and not waiting
    stalled = bool(alive) and idle >= timeout and not outside
    working = tuple(rank for rank in alive if rank not in waiting and works_now(seen.snapshots[rank], now, rules, seen.worked_at)
                    and now - last_active(seen.snapshots[rank], None, now, rules, seen.ours, seen.running, seen.worked_at) < timeout)
    busy = None
    if outside:
        busy = Busy(progress_idle, (), (), stop=progress_idle >= rules.busy_timeout_s, outside=alive)
    elif not stalled and progress_idle >= timeout and waiting and working:
        busy = Busy(progress_idle, working, waiting, stop=progress_idle >= rules.busy_timeout_s)
    if busy is not None and busy.outside:
        reason = (f"no rank was active for {idle:.1f} s and none waits in a collective (rank(s) {_listed(alive)} still "
                  f"run): nobody waits on a peer (busy timeout {rules.busy_timeout_s:g} s)")
    elif busy is not None:
        reason = (f"no rank progressed for {progress_idle:.1f} s while rank(s) {_listed(working)} work and rank(s) "
                  f"{_listed(waiting)} wait in a collective (busy timeout {rules.busy_timeout_s:g} s)")
    elif idle < timeout:
        reason = f"a rank was active {idle:.1f} s ago, within the stall timeout ({timeout:g} s)"
    elif not alive:
        reason = f"no rank was active for {idle:.1f} s, but none is running: the attempt is ending, not stuck"
    else:
        reason = f"no rank was active for {idle:.1f} s (stall timeout {timeout:g} s), and rank(s) {_listed(alive)} still run"
    return StallVerdict(stalled=stalled, idle_s=idle, alive=alive, reason=reason, progress_idle_s=progress_idle, busy=busy)


def _listed(ranks: tuple[int, ...]) -> str:
    return ", ".join(str(rank) for rank in ranks)


def progressing(state: Mapping[str, Any], now: float, rules: StallRules) -> bool:
    """Whether one rank's state alone rules both a stall and a busy stop out: running, and making
    real progress within the stall timeout. Asked of other nodes' ranks, whose processes cannot be
    checked from here."""
    return ("exit" not in state and now - state.get("last_progress", 0.0) < rules.stall_timeout_s
            and rank_alive(state, now, rules))


def remote_read(idle_s: float, rank_ended: bool, rules: StallRules) -> RemoteRead | None:
    """How fresh the other nodes' ranks must be at this poll; None: no need to read them now.

    `idle_s`: how long this node's ranks have made no real progress (working without progress
    counts as none: a rank that works while another node's ranks wait for it must learn that
    they do, to be stopped at the busy timeout on its own node); `rank_ended`: one of them ended
    since the last poll. Once that lasted the stall timeout, whether the job is stuck or busy is
    the other nodes' ranks' to say too: fresh at every poll, until one shows real progress. From half the
    timeout, now and then, so that something is known if the store goes. When one of this node's
    ranks just ended, at once: the attempt may be ending, and node 0's store with it.
    """
    timeout = rules.stall_timeout_s
    if rank_ended or idle_s >= timeout:
        return RemoteRead(rules.poll_s, until_progress=idle_s >= timeout)
    return RemoteRead(timeout / 4, until_progress=False) if idle_s >= timeout / 2 else None
