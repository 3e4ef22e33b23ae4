"""The launcher side of `gradsync run`: watch the workers' published state while torchrun's agent runs.

It reads the snapshots the workers leave in the run directory (never the process group, which
may be the stuck thing), notices a stall long before the backend's timeout, diagnoses it, and
stops the workers so torchrun's agent ends (or restarts) the job; whether it is a stall is
gradsync.run.stall's to say, from what the monitor gathers (the states, the time, which of its
workers still run). It also follows the ranks' collective checkpoints while the job is
healthy, to warn about drift as soon as it shows.
When the agent restarts the workers (--max-restarts), the failed attempt is diagnosed before the
next one starts and its diagnosis stays in that attempt's folder; the final diagnosis tells
what the earlier attempts went through. On several nodes without a shared run folder, each
monitor publishes its ranks' state through the rendezvous store and reads the other nodes' when
its own ranks look stuck or end (gradsync.run.jobwide), so stall detection and the diagnosis are
job-wide; it still stops only its own ranks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import psutil

from gradsync.run import faults
from gradsync.run.analysis.attempts import earlier_attempts_finding, regrouped_finding, unfired_fault_findings
from gradsync.run.analysis.last_words import classify, read_fatal_stack, read_last_words
from gradsync.run.analysis.evidence import Evidence
from gradsync.run.analysis.stragglers import StragglerTracker
from gradsync.run.analysis.views import RankView
from gradsync.run.jobwide import JobBoard, StoreAddress, round_of, world_size_of
from gradsync.run.outside import read_children, with_outside_read
from gradsync.run.stacks import StacksRequest
from gradsync.run.options import RunOptions
from gradsync.run.analysis.working import SERVED_BY_CHILDREN, busy_note, waits_on
from gradsync.run.stall import (
    IDLE, WORKING, Busy, Observation, RemoteRead, StallRules, ThreadCpu, judge, main_thread_worked, progressing, remote_read,
)
from gradsync.rundir import RunDir, layout, read_attempt, read_by_rank, write_json

if TYPE_CHECKING:
    from gradsync.run.moments import ScriptProbe

GRACE_S = 3.0  # between SIGTERM and SIGKILL when stopping a stalled job
# Polls a node waits, after finding a stall that involves other nodes' ranks, before stopping its
# own: the other nodes find it within a poll and a read, and diagnose it from the same state
# rather than from the errors a stop causes.
SETTLE_POLLS = 3
# At most this long, once torchrun's agent found this node's workers failed, for the other nodes'
# ranks to be seen ending and for every node to have read this one's (node 0's store goes when its
# agent returns).
END_WAIT_S = 3.0
END_POLL_S = 0.1


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie has exited; its parent (the agent) has not reaped it yet
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


class Monitor(threading.Thread):
    """Polls the latest attempt's worker files; on a stall, diagnoses and stops the workers.

    While ranks wait in a collective for a rank that keeps working without progress (the busy
    clock of gradsync.run.stall.judge), it prints and records a note once that lasted the stall
    timeout, and diagnoses and stops the workers only at the busy timeout.

    Stopping them is what makes torchrun's agent see the attempt fail, so it restarts the group
    when restarts remain; the next attempt's files are watched afresh.
    """

    def __init__(self, options: RunOptions, report: Callable[[dict[str, Any], Path], None], store: StoreAddress | None = None,
                 clock: Callable[[], float] = time.time, probe: ScriptProbe | None = None):
        """`store`: the rendezvous store of a multi-node job, for the job-wide view (None: this node's ranks only).
        `clock`: the time (time.time()) the ranks' states are judged at; a test gives its own.
        `probe`: the script check whose rules judge what `--doctor-steps` had the ranks record."""
        super().__init__(name="gradsync-monitor", daemon=True)
        self.options = options
        self.probe = probe
        self.report = report
        self.run_dir = Path(options.run_dir)
        self.folder = RunDir(self.run_dir)
        self.rules = StallRules.of(options)
        self.poll_s = self.rules.poll_s
        self.clock = clock
        self.stopped = threading.Event()
        self.attempt: int | None = None
        self.stall_diagnoses: dict[int, dict[str, Any]] = {}
        self.restarts = 0  # attempts the agent replaced so far, so also the number of the current one
        self.failed_attempts: dict[int, dict[str, Any]] = {}
        self.regrouped: dict[int, int] = {}  # attempt stopped for a membership change -> its world size
        self.stopped_pids: set[int] = set()
        self.trackers: dict[int, StragglerTracker] = {}
        self.drift_warned = False
        self.board = JobBoard(store, options.snapshot_interval_s) if store is not None else None
        self.own_pids: set[int] = set()  # the workers this launcher was seen to run, exited ones included
        self.exits_seen: dict[int, int] = {}  # attempt -> this node's exit records at the last poll
        self.agent_exits: dict[int, dict[int, dict[str, Any]]] = {}  # attempt -> rank -> how the agent saw it end
        self.silent: dict[int, set[int]] = {}  # attempt -> other nodes' ranks whose end never reached this node
        self.main_thread_cpu: dict[int, ThreadCpu] = {}  # rank's PID -> its main thread's CPU at the last poll
        self.worked_at: dict[int, float] = {}  # rank's PID -> when its main thread was last seen using CPU
        self.notes: dict[int, list[dict[str, Any]]] = {}  # attempt -> the busy notes printed, oldest first
        self.noted: dict[int, float] = {}  # attempt -> the last progress whose busy spell was noted
        self.relayed_stacks: str | None = None  # the last `gradsync stacks` request passed on to this node's ranks

    def run(self) -> None:
        while not self.stopped.wait(self.poll_s):
            try:
                self.poll()
            except Exception as error:  # the monitor must never take the job down with it
                print(f"gradsync run: monitor error (the job continues unwatched): {error!r}", file=sys.stderr)
                return

    def stop(self) -> None:
        self.stopped.set()
        if self.is_alive():
            self.join(timeout=5)

    def tracker(self, attempt: int) -> StragglerTracker:
        if attempt not in self.trackers:
            self.trackers[attempt] = StragglerTracker(self.options.straggler_ratio, self.options.straggler_min_s)
        return self.trackers[attempt]

    def poll(self) -> None:
        attempt = self.folder.latest_attempt()
        if attempt is None:
            return
        self.attempt = attempt
        snapshots, exits = read_attempt(self.folder, attempt)
        if not snapshots:
            return
        ours = _worker_pids()
        self._relay_stacks_request()
        self._publish(attempt, snapshots, exits, ours)  # after a stall too: the others learn what was stopped
        if attempt in self.stall_diagnoses:
            return
        snapshots, exits = self._held_after_exit(snapshots, exits, ours, self.clock())
        expected = max(s.get("local_world_size", 1) for s in snapshots.values())
        if len(snapshots) < expected:
            return  # still starting
        self.tracker(attempt).observe(snapshots)
        self._warn_on_drift(snapshots)
        now = self.clock()
        self._read_main_threads(snapshots, ours, now)
        verdict = judge(self._observe(snapshots, exits, ours, now), self.rules)
        read = self._remote_read(attempt, verdict.progress_idle_s, exits)
        if read is not None:
            # Whether the job is stuck or kept busy: a rank on another node that progresses says
            # no, and one is enough to know it.
            until = (lambda s: progressing(s, now, self.rules)) if read.until_progress else None
            snapshots, exits = self._job_wide(attempt, snapshots, exits, read.max_age_s, until=until)
            verdict = judge(self._observe(snapshots, exits, ours, now), self.rules)
        if verdict.stalled:
            self._on_stall(attempt, snapshots, exits, verdict.alive, now, ours)
        elif verdict.busy is not None and verdict.busy.stop:
            self._on_stall(attempt, snapshots, exits, verdict.alive, now, ours, busy=verdict.busy)
        elif verdict.busy is not None:
            self._note_busy(attempt, snapshots, exits, verdict.busy, now)

    def _held_after_exit(self, snapshots, exits, ours: set[int], now: float) -> tuple[dict, dict]:
        """A rank of this node that left its exit record more than the stall timeout ago and whose
        process still runs is held at its exit past the script's threads: an exit handler (one
        joining a multiprocessing queue's feeder thread), a library's destructor at interpreter
        exit. Judged as a rank whose script ended and whose process waits (gradsync.run.script_exit):
        its record is its last state, with `ending` saying how the script ended, and no exit."""
        held = [rank for rank, record in exits.items()
                if record.get("pid") in ours and not record.get("remote") and isinstance(record.get("exit"), dict)
                and now - record["exit"].get("time", now) > self.rules.stall_timeout_s and pid_alive(record["pid"])]
        if not held:
            return snapshots, exits
        snapshots, exits = dict(snapshots), dict(exits)
        for rank in held:
            record = exits.pop(rank)
            ending = {**record["exit"], "threads": [], "after_exit_handlers": True}
            snapshots[rank] = {**{k: v for k, v in record.items() if k != "exit"}, "ending": ending,
                               "activity": {**(record.get("activity") or {}), "state": IDLE, "position": None}}
        return snapshots, exits

    def _observe(self, snapshots, exits, ours: set[int], now: float) -> Observation:
        """What the stall rule judges: the states as read and, of the ranks this launcher runs
        that left no exit record, whose process still runs and when its main thread last worked."""
        running = {s["pid"] for rank, s in snapshots.items()
                   if rank not in exits and s["pid"] in ours and not s.get("remote") and pid_alive(s["pid"])}
        worked_at = {pid: at for pid, at in self.worked_at.items() if pid in running}
        return Observation(snapshots, exits, now, frozenset(ours), frozenset(running), worked_at)

    def _read_silent_rank(self, view: RankView, ours: set[int], now: float) -> None:
        """A rank of this node whose reports stopped (its main thread holds the GIL in a native
        call, or it was stopped) is read from outside (gradsync.run.outside): its line, whether it
        runs, who holds the GIL. The read replaces its last report's position in the view, and is
        kept in the snapshot ("outside_read") with its time; where it fails, why ("outside_read_failed")."""
        snapshot = view.snapshot or {}
        if snapshot.get("remote") or snapshot.get("pid") not in ours:
            return
        silent_s = now - snapshot.get("time", now)
        if silent_s <= self.rules.snapshot_max_age_s(remote=False):
            return
        view.snapshot = with_outside_read(snapshot, silent_s, WORKING, IDLE)

    def _read_children(self, view: RankView, ours: set[int]) -> None:
        """A rank of this node that waits on what its child processes serve (its DataLoader's
        workers, a multiprocessing pool or queue, a subprocess) has them read from outside
        (gradsync.run.outside.read_children): where each is, for a loader or a pool that hangs. Kept
        in the snapshot as "children"."""
        snapshot = view.snapshot or {}
        if snapshot.get("remote") or snapshot.get("pid") not in ours or waits_on(view) not in SERVED_BY_CHILDREN:
            return
        children = read_children(snapshot["pid"], snapshot.get("cwd"))
        if children:
            view.snapshot = {**snapshot, "children": children}

    def _read_main_threads(self, snapshots, ours: set[int], now: float) -> None:
        """Read this node's ranks' main threads from /proc, noting when each was last seen using
        CPU: what the stall rule asks of a rank whose snapshots stopped coming."""
        readings = {}
        for pid in {s["pid"] for s in snapshots.values() if s["pid"] in ours and not s.get("remote")}:
            cpu_s = _main_thread_cpu_s(pid)
            if cpu_s is None:
                continue
            readings[pid] = ThreadCpu(now, cpu_s)
            if main_thread_worked(self.main_thread_cpu.get(pid), readings[pid]):
                self.worked_at[pid] = now
        self.main_thread_cpu = readings
        self.worked_at = {pid: at for pid, at in self.worked_at.items() if pid in readings}  # gone PIDs may be reused

    def _remote_read(self, attempt: int, idle: float, exits: dict[int, dict[str, Any]]) -> RemoteRead | None:
        """How to read the other nodes' ranks at this poll (see stall.remote_read); None: not now,
        or there are no other nodes to read. Counts this node's exit records as it goes."""
        if self.board is None:
            return None
        ended = len(exits) > self.exits_seen.get(attempt, 0)
        self.exits_seen[attempt] = len(exits)
        return remote_read(idle, ended, self.rules)

    def _relay_stacks_request(self) -> None:
        """A `gradsync stacks` asked through the store (on any node) reaches this node's ranks as
        their run folder's request file (gradsync.run.stacks), stamped with this node's clock."""
        if self.board is None:
            return
        request = self.board.stacks_request()
        if request is not None and request != self.relayed_stacks:
            self.relayed_stacks = request
            with contextlib.suppress(OSError):
                StacksRequest(request, time.time()).write(self.folder.stacks_request)

    def _publish(self, attempt: int, snapshots, exits, ours: set[int]) -> set[int]:
        """Put the state of the ranks this launcher runs on the job board, with how torchrun's
        agent saw them end; returns those ranks. In a shared run folder the other nodes' ranks
        are there too: they are theirs to publish."""
        if self.board is None:
            return set()
        self.own_pids.update(s["pid"] for s in snapshots.values() if s.get("pid") in ours)
        own = {rank: exits.get(rank) or s for rank, s in snapshots.items() if s.get("pid") in self.own_pids}
        ended = self.agent_exits.get(attempt, {})
        own = {rank: {**state, "agent_exit": ended[rank]} if rank in ended else state for rank, state in own.items()}
        own = {rank: self._with_last_words(attempt, rank, state) for rank, state in own.items()}
        stopped = {rank for rank, s in own.items() if s.get("pid") in self.stopped_pids}
        self.board.publish(round_of(attempt, snapshots, exits), own, stopped)
        return set(own)

    def _with_last_words(self, attempt: int, rank: int, state: dict[str, Any]) -> dict[str, Any]:
        """An ended rank's state with the end of its log: what it said as it died (a backend's
        "580 vs 4", an allocation failure) is in a file only this node has, and another node's
        diagnosis of the same end must read it too."""
        if "exit" not in state and "agent_exit" not in state:
            return state
        words = read_last_words(self.folder.log(attempt, rank))
        fatal = read_fatal_stack(self.folder.fatal(attempt, rank), state.get("cwd"))
        return {**state, **({"last_words": list(words.lines)} if words is not None else {}),
                **({"fatal_stack": fatal} if fatal is not None else {})}

    def _job_wide(self, attempt: int, snapshots, exits, max_age_s: float, not_before: float = 0.0,
                  until: Callable[[dict[str, Any]], bool] | None = None) -> tuple[dict, dict]:
        """The attempt's snapshots and exit records with the other nodes' ranks added (see
        JobBoard.read for `max_age_s`, `not_before` and `until`); this node's own files win."""
        assert self.board is not None
        local = set(snapshots) | set(exits)
        remote = self.board.read(round_of(attempt, snapshots, exits), world_size_of({**snapshots, **exits}), local, max_age_s,
                                 not_before, until)
        remote = {rank: state for rank, state in remote.items() if rank not in snapshots and rank not in exits}
        return {**remote, **snapshots}, {**{r: s for r, s in remote.items() if "exit" in s}, **exits}

    def _warn_on_drift(self, snapshots: dict[int, dict[str, Any]]) -> None:
        if self.drift_warned:
            return
        for group in {g for s in snapshots.values() for g in s.get("groups", {})}:
            checkpoints = [dict(map(tuple, s["groups"][group]["checkpoints"])) for s in snapshots.values() if group in s.get("groups", {})]
            if len(checkpoints) < 2:
                continue
            for seq in sorted(set.intersection(*(set(c) for c in checkpoints))):
                if len({c[seq] for c in checkpoints}) > 1:
                    self.drift_warned = True
                    where = "the default group" if group == "default" else group
                    print(
                        f"gradsync run: warning: the ranks' collective sequences on {where} differ at or "
                        f"before collective #{seq}; the diagnosis at exit will say where.",
                        file=sys.stderr,
                    )
                    return

    def _note_busy(self, attempt: int, snapshots, exits, busy: Busy, now: float) -> None:
        """Print and record, once per spell without progress, who works where and who waits where."""
        progressed = round(now - busy.for_s, 3)
        if self.noted.get(attempt) == progressed:
            return
        self.noted[attempt] = progressed
        views = build_views(snapshots, exits, failures={}, stopped=set(), fired={})
        note = busy_note(views, busy, now, attempt, self.options.stall_timeout_s, self.rules.busy_timeout_s).as_dict()
        earlier = (self.notes.get(attempt) or [None])[-1]
        if earlier is not None and (earlier["working"], earlier["waiting"]) == (note["working"], note["waiting"]):
            # The same ranks at the same lines: a peer that only now entered the collective it waits
            # in (a slow start) moved the spell's start, not the situation. Said once.
            return
        self.notes.setdefault(attempt, []).append(note)
        try:
            print(f"gradsync run: note: {note['message']}", file=sys.stderr, flush=True)
        except OSError:  # a closed console must not stop the watch
            pass

    def _on_stall(self, attempt: int, snapshots, exits, alive: Sequence[int], now: float, ours: set[int],
                  busy: Busy | None = None) -> None:
        """Diagnose and stop the attempt: stalled, or kept busy past the busy timeout (`busy`)."""
        views = build_views(snapshots, exits, failures={}, stopped=set(), fired=self._faults(attempt))
        self._read_last_words(attempt, views)
        for rank in alive:
            views[rank].alive = True
            self._read_silent_rank(views[rank], ours, now)
            self._read_children(views[rank], ours)
        for rank, view in views.items():
            # Of another node, its state stale and no word of its end: what it last said is old news.
            view.unreachable = bool((view.snapshot or {}).get("remote")) and not view.alive and view.exit is None and view.exitcode is None
        if self.board is not None and not self.board.reachable:
            # The store the nodes share did not answer: the ranks never heard of are out of reach.
            for rank in set(range(world_size_of(snapshots))) - set(views):
                views[rank] = RankView(rank, unreachable=True)
        diagnosis = self._diagnose_kept(attempt, Evidence(
            views,
            trigger="stall",
            now=now,
            world_size=world_size_of(snapshots),
            stragglers=self.tracker(attempt).findings(),
            script_checks=self._script_checks(attempt),
        ))
        diagnosis["stall_timeout_s"] = self.options.stall_timeout_s
        diagnosis["busy_timeout_s"] = self.rules.busy_timeout_s
        diagnosis["stopped_at"] = "stall_timeout" if busy is None else "busy_timeout"
        if busy is not None:
            diagnosis["busy_for_s"] = round(busy.for_s, 1)
        diagnosis["attempt"] = attempt
        self._add_notes(diagnosis, attempt)
        self.stall_diagnoses[attempt] = diagnosis
        try:
            self.report(diagnosis, self.run_dir)
        except OSError:  # a closed console (`| head`) must not leave the stuck workers running
            pass
        if any(s.get("remote") for s in snapshots.values()):
            self.stopped.wait(SETTLE_POLLS * self.poll_s)
        # Only this launcher's own workers: a PID from another node's snapshot names some other
        # process here. Each node's launcher stops its own ranks.
        pids = [snapshots[rank]["pid"] for rank in alive if snapshots[rank]["pid"] in ours and not snapshots[rank].get("remote")]
        self.stopped_pids.update(pids)
        _stop(pids)

    def restarting(self, failures: dict[int, Any]) -> None:
        """The agent stopped a failed attempt and is about to start the next: keep and show its diagnosis."""
        attempt = self.restarts
        self.restarts += 1
        diagnosis = self.stall_diagnoses.get(attempt)  # a stall was shown when it was found
        if diagnosis is None:
            diagnosis = self._diagnose(attempt, failures)
            self.report(diagnosis, self.run_dir)
        self.failed_attempts[attempt] = diagnosis
        print(
            f"gradsync run: restarting the workers as attempt {attempt + 1} (--max-restarts); attempt "
            f"{attempt}'s diagnosis stays in {self.folder.attempt_diagnosis(attempt)}",
            file=sys.stderr,
            flush=True,
        )

    def regrouping(self) -> None:
        """The agent stopped this node's healthy workers to start them again with the nodes the
        rendezvous has now (a node joined an elastic job): not a failure, and no restart of
        --max-restarts is used up."""
        attempt = self.restarts
        self.restarts += 1
        snapshots, exits = read_attempt(self.folder, attempt)
        self.regrouped[attempt] = world_size_of({**snapshots, **exits}) if (snapshots or exits) else 0
        print(
            f"gradsync run: the job's nodes changed (a node joined): restarting the workers as attempt {attempt + 1} "
            f"with the new membership; attempt {attempt} was stopped for it, not for a failure",
            file=sys.stderr,
            flush=True,
        )

    def agent_ended(self, failures: dict[int, Any]) -> None:
        """torchrun's agent found this node's workers failed (`failures`: global rank ->
        ProcessFailure, as it returns them) and is about to end or restart the attempt: tell the
        other nodes how these ranks ended, and learn how theirs did, while node 0's store is up.

        The agent's exit code and signal of each failed rank go out with its state at once (a
        rank killed by a signal leaves no exit record, so the other nodes know it only thus).
        Then, for END_WAIT_S at most, the other nodes' ranks are read until each has ended, this
        node says it has them (JobBoard.done), and it waits for every node to say so: node 0's
        store goes when its agent returns, and the others read this node's ends from it.
        """
        if self.board is None:
            return
        attempt = self.folder.latest_attempt()
        attempt = self.restarts if attempt is None else attempt
        self.agent_exits.setdefault(attempt, {}).update({rank: _agent_exit(failure) for rank, failure in failures.items()})
        self.own_pids.update(f.pid for f in failures.values() if isinstance(getattr(f, "pid", None), int))
        snapshots, exits = read_attempt(self.folder, attempt)
        if not snapshots and not exits:
            return  # no rank of this node reported: nothing to say, and the job's size is not known
        own = self._publish(attempt, snapshots, exits, _worker_pids())
        local = set(snapshots) | set(exits)
        world_size = world_size_of({**snapshots, **exits})
        others = set(range(world_size)) - local
        deadline = time.monotonic() + END_WAIT_S
        ended: set[int] = set()
        round_key = round_of(attempt, snapshots, exits)
        while self.board.reachable and time.monotonic() < deadline:
            remote = self.board.read(round_key, world_size, local, max_age_s=0.0)
            ended = {rank for rank, s in remote.items() if "exit" in s or "agent_exit" in s}
            if ended >= others:
                break
            time.sleep(END_POLL_S)
        # Ranks whose end no word reached in that time: their node (or the way to it) is gone.
        self.silent[attempt] = others - ended
        self.board.done(round_key, len(own))
        while time.monotonic() < deadline and not self.board.all_done(round_key, world_size):
            time.sleep(END_POLL_S)

    def final(self, failures: dict[int, Any]) -> dict[str, Any]:
        """The diagnosis of the job once torchrun's agent returned (`failures`: the last attempt's).

        It is the last attempt's, plus what the earlier attempts went through and the injected
        faults that never fired.
        """
        attempt = self.restarts
        diagnosis = self.stall_diagnoses.get(attempt) or self._diagnose(attempt, failures)
        if self.failed_attempts:
            diagnosis["findings"].append(earlier_attempts_finding(self.failed_attempts, diagnosis["status"], attempt).as_dict())
        if self.regrouped:
            diagnosis["findings"].append(regrouped_finding(self.regrouped).as_dict())
        fired = {a: self._faults(a) for a in range(attempt + 1)}
        unfired = unfired_fault_findings(faults.parse_faults(self.options.faults), fired, attempt)
        diagnosis["findings"] += [finding.as_dict() for finding in unfired]
        ended = {**self.failed_attempts, attempt: diagnosis}
        diagnosis["attempts"] = [
            {"attempt": a, "status": "regrouped" if a in self.regrouped else ended[a]["status"],
             "diagnosis": str(self.folder.attempt_diagnosis(a))}
            for a in sorted({*ended, *self.regrouped})
        ]
        return diagnosis

    def _diagnose(self, attempt: int, failures: dict[int, Any]) -> dict[str, Any]:
        """One attempt's diagnosis after its workers ended (`failures`: what the agent saw of them)."""
        snapshots, exits = read_attempt(self.folder, attempt)
        local = snapshots
        if self.board is not None and (snapshots or exits):
            self._publish(attempt, snapshots, exits, _worker_pids())
            # The store may be gone by now (node 0's agent ends with its workers): then the others'
            # ranks as last read, if that read saw this attempt end here. An older one (say, from
            # start-up, while this node waited for the others) would show them where they no
            # longer were.
            now = self.clock()
            ended = min([(e.get("exit") or {}).get("time", now) for e in exits.values()]
                        + [s.get("time", now) for r, s in snapshots.items() if r not in exits])
            snapshots, exits = self._job_wide(attempt, snapshots, exits, 0.0, ended - self.options.snapshot_interval_s)
        if not snapshots and not exits:
            diagnosis = {
                "status": "failed" if failures else "ok",
                "trigger": "failure" if failures else "exit",
                "findings": [],
                "ranks": {},
                "note": "no worker reported: they failed before the recorder started (see their output above)",
            }
        else:
            views = build_views(snapshots, exits, failures, self.stopped_pids, self._faults(attempt))
            self._read_last_words(attempt, views)
            for rank in self.silent.get(attempt, ()):
                view = views.setdefault(rank, RankView(rank))
                view.unreachable = view.exit is None and view.exitcode is None
            tracker = self.tracker(attempt)
            tracker.observe(local)  # as while the job ran: this node's ranks
            diagnosis = self._diagnose_kept(attempt, Evidence(
                views,
                trigger="failure" if failures else "exit",
                now=self.clock(),
                world_size=world_size_of({**snapshots, **exits}),
                stragglers=tracker.findings(),
                script_checks=self._script_checks(attempt),
            ))
        diagnosis["attempt"] = attempt
        self._add_notes(diagnosis, attempt)
        return diagnosis

    def _diagnose_kept(self, attempt: int, evidence: Evidence) -> dict[str, Any]:
        """The diagnosis made from `evidence`, which is kept beside it so that it can be made again."""
        try:
            write_json(self.folder.attempt_evidence(attempt), evidence.as_dict())
        except (OSError, TypeError, ValueError):  # a full disk or an odd record must not cost the diagnosis
            pass
        return evidence.diagnose(self.probe)

    def _read_last_words(self, attempt: int, views: dict[int, RankView]) -> None:
        """Each rank's last words: from its log on this node, or as its own node published them."""
        for rank, view in views.items():
            snapshot = view.snapshot or {}
            if not snapshot.get("remote"):
                view.last_words = read_last_words(self.folder.log(attempt, rank))
                if view.signal is not None:  # faulthandler writes only at a fatal signal
                    view.fatal_stack = read_fatal_stack(self.folder.fatal(attempt, rank), snapshot.get("cwd"))
                # The worker's dump is the evidence, whatever the rank raised first: torch's "DataLoader
                # worker ... is killed by signal", or a ConnectionResetError from the dying worker's queue.
                if view.exception() is not None:
                    view.loader_worker_fatal_stack = read_fatal_stack(self.folder.fatal_of_loader_workers(attempt, rank),
                                                                      snapshot.get("cwd"))
            else:
                if isinstance(snapshot.get("last_words"), list):
                    words = classify("\n".join(str(line) for line in snapshot["last_words"]))
                    view.last_words = words if words.lines else None
                if isinstance(snapshot.get("fatal_stack"), list) and view.signal is not None:
                    view.fatal_stack = [str(site) for site in snapshot["fatal_stack"]]

    def _add_notes(self, diagnosis: dict[str, Any], attempt: int) -> None:
        """The busy notes printed during the attempt, recorded with its diagnosis."""
        if self.notes.get(attempt):
            diagnosis["notes"] = list(self.notes[attempt])

    def _faults(self, attempt: int) -> dict[int, dict[str, Any]]:
        """The injected faults that fired in `attempt`, by rank."""
        return read_by_rank(self.folder, attempt, layout.FAULT)

    def _script_checks(self, attempt: int) -> dict[int, dict[str, Any]]:
        """What --doctor-steps saw on each rank of `attempt`."""
        return read_by_rank(self.folder, attempt, layout.SCRIPT_CHECK)


def build_views(snapshots, exits, failures: dict[int, Any], stopped: set[int], fired: dict[int, dict]) -> dict[int, RankView]:
    """Join each rank's files with what the agent saw (exit code, signal), what gradsync stopped and
    the injected faults that `fired`."""
    views = {}
    for rank in sorted(set(snapshots) | set(exits) | set(failures) | set(fired)):
        exit_record = exits.get(rank)
        snapshot = exit_record or snapshots.get(rank)
        failure = failures.get(rank)
        # What this node's agent saw, else, for another node's rank, what its agent saw and published.
        if failure is not None:
            ended = _agent_exit(failure)
        else:
            ended = (snapshot or {}).get("agent_exit") if (snapshot or {}).get("remote") else None
        ended = ended if isinstance(ended, dict) else {}
        exitcode = ended.get("exitcode") if isinstance(ended.get("exitcode"), int) else None
        signal_name = ended.get("signal") if exitcode is not None and exitcode < 0 else None
        views[rank] = RankView(
            rank=rank,
            snapshot=snapshot,
            # A rank whose process waits for the script's threads has ended its script all the same.
            exit=(exit_record or {}).get("exit") or _script_ended(snapshot),
            exitcode=exitcode,
            signal=signal_name,
            stopped_by_gradsync=snapshot is not None and _stopped(snapshot, stopped),
            injected=fired.get(rank),
        )
    return views


def _script_ended(snapshot: dict[str, Any] | None) -> dict[str, Any] | None:
    """How the script of a rank held at its exit ended (gradsync.run.script_exit), as its exit record would say."""
    ending = (snapshot or {}).get("ending")
    return {key: value for key, value in ending.items() if key != "threads"} if isinstance(ending, dict) else None


def _agent_exit(failure: Any) -> dict[str, Any]:
    """How torchrun's agent saw a rank end (a ProcessFailure), as it is published."""
    exitcode = getattr(failure, "exitcode", None)
    signal_name = None
    if isinstance(exitcode, int) and exitcode < 0:
        try:
            signal_name = failure.signal_name()
        except Exception:
            signal_name = None
    return {"exitcode": exitcode if isinstance(exitcode, int) else None, "signal": signal_name}


def _stopped(snapshot: dict[str, Any], stopped_pids: set[int]) -> bool:
    """Whether gradsync stopped the rank: this launcher (its PID is one it stopped) or, for a rank
    of another node, that node's launcher (as it published)."""
    if snapshot.get("remote"):
        return bool(snapshot.get("stopped_by_gradsync"))
    return snapshot.get("pid") in stopped_pids


def _stop(pids: list[int]) -> None:
    """SIGTERM the stalled workers, then SIGKILL what is left of their process trees.

    Only the workers get the SIGTERM (a script may save on it, and its children are its own to
    stop); but DataLoader workers and spawned children of a worker stuck for good would outlive
    it, keeping memory (GPU memory on a GPU machine), so the whole tree goes after the grace.
    """
    tree = {process.pid: process for pid in pids for process in _descendants(pid)}
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.time() + GRACE_S
    while time.time() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.1)
    for pid in pids:
        tree.update({process.pid: process for process in _descendants(pid)})  # children started since
        if pid_alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for process in tree.values():
        try:
            process.kill()  # psutil checks the pid still names the same process
        except psutil.Error:
            pass


def _main_thread_cpu_s(pid: int) -> float | None:
    """The CPU seconds process `pid`'s main thread (the thread whose id is the PID) has used; None
    where /proc cannot tell (the process is gone, or not Linux)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime, in clock ticks
    except (OSError, IndexError, ValueError):
        return None


def _worker_pids() -> set[int]:
    """The processes this launcher started (the agent's workers and theirs)."""
    return {process.pid for process in _descendants(os.getpid())}


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
