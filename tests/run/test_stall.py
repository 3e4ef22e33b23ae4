"""The stall rules of `gradsync run` (gradsync.run.stall), on given readings, states and a given `now`.

No process, no clock, no sleep: every time is set relative to NOW, and every threshold is met
just below, at and just above it (the rules' numbers are exact in binary, so "at" is exact).
"""

from __future__ import annotations

import pytest

from gradsync.run.options import RunOptions
from gradsync.run.stall import (
    BUSY_SHARE,
    IDLE,
    WAITING,
    WORKING,
    Busy,
    CpuReading,
    Observation,
    RemoteRead,
    StallRules,
    ThreadCpu,
    in_native_call,
    judge,
    last_active,
    last_progressed,
    main_thread_worked,
    progressing,
    rank_alive,
    rank_state,
    remote_read,
    tree_worked,
)

NOW = 1000.0
TIMEOUT = 8.0
BUSY_TIMEOUT = 32.0
RULES = StallRules(stall_timeout_s=TIMEOUT, snapshot_interval_s=0.5, busy_timeout_s=BUSY_TIMEOUT)
LOCAL_MAX_AGE = 3 * 0.5 + 1  # 2.5 s: a snapshot in this node's (or a shared) run folder
REMOTE_MAX_AGE = 3 * 0.5 + 1 + 2 * 0.5  # 3.5 s: one read through the job board
EPS = 0.25
OWN, STRANGER = 4242, 5151  # a PID this launcher started, and one it did not


def snapshot(pid: int = OWN, seen: float = 0.0, progressed: float = 0.0, **extra) -> dict:
    """A rank's snapshot written `seen` seconds before NOW, its last progress `progressed` seconds
    before, found waiting in a collective (a communication stall) unless `activity` says otherwise."""
    return {"pid": pid, "time": NOW - seen, "last_progress": NOW - progressed, "activity": {"state": WAITING}, **extra}


def exit_record(ago: float, pid: int = OWN) -> dict:
    return {**snapshot(pid, seen=ago, progressed=ago), "exit": {"status": "finished", "code": 0, "time": NOW - ago}}


def observe(snapshots: dict, exits: dict | None = None, running: set[int] = frozenset({OWN}),
            worked_at: dict[int, float] | None = None) -> Observation:
    """The attempt at NOW, where this launcher started OWN, `running` of its processes still run,
    and `worked_at` says when the monitor last saw their main threads use CPU."""
    return Observation(snapshots, exits or {}, NOW, ours=frozenset({OWN}), running=frozenset(running),
                       worked_at=worked_at or {})


# -- the thresholds -------------------------------------------------------------------------------


def test_the_rules_are_the_run_options_thresholds(tmp_path):
    assert StallRules.of(RunOptions(run_dir=tmp_path, stall_timeout_s=120)) == StallRules(120.0, 1.0)
    short = StallRules.of(RunOptions(run_dir=tmp_path, stall_timeout_s=2))
    assert (short.stall_timeout_s, short.snapshot_interval_s, short.poll_s) == (2, 0.4, 0.4)
    assert StallRules(120.0, 1.0).poll_s == 0.5
    assert (RULES.snapshot_max_age_s(remote=False), RULES.snapshot_max_age_s(remote=True)) == (LOCAL_MAX_AGE, REMOTE_MAX_AGE)


# -- idle time and the stall timeout --------------------------------------------------------------


@pytest.mark.parametrize("idle, stalled", [(TIMEOUT - EPS, False), (TIMEOUT, True), (TIMEOUT + EPS, True)])
def test_a_running_rank_idle_for_the_stall_timeout_is_stalled(idle, stalled):
    verdict = judge(observe({0: snapshot(progressed=idle)}), RULES)
    assert (verdict.stalled, verdict.idle_s, verdict.alive) == (stalled, idle, (0,))
    assert verdict.reason.startswith("no rank was active" if stalled else "a rank was active"), verdict.reason


def test_the_most_recently_active_rank_sets_the_idle_time():
    ranks = {0: snapshot(progressed=TIMEOUT + 30), 1: snapshot(progressed=TIMEOUT - EPS), 2: snapshot(progressed=TIMEOUT + 1)}
    verdict = judge(observe(ranks), RULES)
    assert (verdict.stalled, verdict.idle_s, verdict.alive) == (False, TIMEOUT - EPS, (0, 1, 2))
    ranks[1] = snapshot(progressed=TIMEOUT)
    verdict = judge(observe(ranks), RULES)
    assert (verdict.stalled, verdict.idle_s) == (True, TIMEOUT)
    assert "rank(s) 0, 1, 2 still run" in verdict.reason


# -- whether a rank is alive ----------------------------------------------------------------------


@pytest.mark.parametrize("process_runs", [True, False])
def test_a_rank_this_launcher_runs_is_alive_exactly_while_its_process_runs(process_runs):
    """Whatever its snapshot's age: a process that froze (SIGSTOP) writes none, yet is stuck, not gone."""
    old = snapshot(seen=100.0, progressed=100.0)
    assert rank_alive(old, NOW, RULES, ours={OWN}, running={OWN} if process_runs else set()) is process_runs
    fresh = snapshot(seen=0.0)
    assert rank_alive(fresh, NOW, RULES, ours={OWN}, running={OWN} if process_runs else set()) is process_runs


def test_a_rank_whose_process_ended_without_a_record_was_last_active_when_last_seen():
    """A rank that just died (killed, no exit record) means the attempt is ending: its idle time
    counts from its last snapshot, not from its last progress."""
    gone = snapshot(seen=1.0, progressed=TIMEOUT + 30)
    assert last_active(gone, None, NOW, RULES, ours={OWN}, running=set()) == NOW - 1.0
    assert last_active(gone, None, NOW, RULES, ours={OWN}, running={OWN}) == NOW - (TIMEOUT + 30)
    verdict = judge(observe({0: gone, 1: snapshot(pid=OWN + 1, seen=TIMEOUT + 30, progressed=TIMEOUT + 30)}, running=set()), RULES)
    assert (verdict.stalled, verdict.idle_s, verdict.alive) == (False, 1.0, ())


def test_no_running_rank_is_no_stall_however_long_the_idle_time():
    verdict = judge(observe({0: snapshot(seen=TIMEOUT + 1, progressed=TIMEOUT + 30)}, running=set()), RULES)
    assert (verdict.stalled, verdict.idle_s, verdict.alive) == (False, TIMEOUT + 1, ())
    assert "none is running" in verdict.reason


@pytest.mark.parametrize("remote, max_age", [(False, LOCAL_MAX_AGE), (True, REMOTE_MAX_AGE)])
@pytest.mark.parametrize("below", [EPS, 0.0, -EPS])
def test_a_rank_of_another_node_is_alive_while_its_snapshot_is_fresh(remote, max_age, below):
    """Another node's rank: in a shared run folder (its PID is not this launcher's) or read from
    the job board ("remote", which adds two intervals); alive while its snapshot is younger than
    the limit, strictly."""
    state = snapshot(pid=STRANGER, seen=max_age - below, progressed=TIMEOUT + 30, **({"remote": True} if remote else {}))
    alive = below > 0
    assert rank_alive(state, NOW, RULES, ours={OWN}, running={OWN}) is alive
    verdict = judge(observe({1: state}), RULES)
    assert verdict.alive == ((1,) if alive else ())
    # Alive, it was last active at its last progress; gone, when it was last seen.
    assert verdict.idle_s == (TIMEOUT + 30 if alive else max_age - below)
    assert verdict.stalled is alive


def test_the_pid_of_another_nodes_rank_means_nothing_here():
    """Published through the board, a rank whose PID names one of this launcher's processes is
    still judged by its snapshot's age."""
    stale = snapshot(pid=OWN, seen=REMOTE_MAX_AGE, remote=True)
    assert not rank_alive(stale, NOW, RULES, ours={OWN}, running={OWN})
    fresh = snapshot(pid=OWN, seen=REMOTE_MAX_AGE - EPS, remote=True)
    assert rank_alive(fresh, NOW, RULES, ours={OWN}, running=set())


def test_a_rank_whose_agent_saw_it_end_is_not_alive():
    ended = snapshot(pid=STRANGER, seen=0.0, progressed=TIMEOUT + 30, remote=True, agent_exit={"exitcode": -9, "signal": "SIGKILL"})
    assert not rank_alive(ended, NOW, RULES)
    verdict = judge(observe({1: ended, 0: snapshot(progressed=TIMEOUT + 30)}), RULES)
    assert (verdict.stalled, verdict.idle_s, verdict.alive) == (False, 0.0, (0,))


# -- a rank whose snapshots stopped coming -------------------------------------------------------


@pytest.mark.parametrize("silent_for, worked_ago, last_active_ago", [
    (LOCAL_MAX_AGE + EPS, 1.0, 1.0),  # its writer is held up while its main thread works
    (LOCAL_MAX_AGE + EPS, TIMEOUT + 40, TIMEOUT + 30),  # worked before its last progress: that counts
    (LOCAL_MAX_AGE + EPS, None, TIMEOUT + 30),  # neither writes nor was seen working: its last progress
    (LOCAL_MAX_AGE, 1.0, TIMEOUT + 30),  # at the limit the snapshot still speaks for the rank
    (LOCAL_MAX_AGE - EPS, 1.0, TIMEOUT + 30),  # fresh: its own judgement (a spin-wait in a collective is no progress)
])
def test_a_rank_whose_snapshots_stopped_was_last_active_when_its_main_thread_last_worked(silent_for, worked_ago, last_active_ago):
    state = snapshot(seen=silent_for, progressed=TIMEOUT + 30)
    worked_at = {} if worked_ago is None else {OWN: NOW - worked_ago}
    assert last_active(state, None, NOW, RULES, ours={OWN}, running={OWN}, worked_at=worked_at) == NOW - last_active_ago


@pytest.mark.parametrize("worked_ago, stalled", [(TIMEOUT - EPS, False), (TIMEOUT, True)])
def test_a_silent_rank_whose_main_thread_worked_within_the_stall_timeout_is_no_stall(worked_ago, stalled):
    verdict = judge(observe({0: snapshot(seen=TIMEOUT + 30, progressed=TIMEOUT + 30)}, worked_at={OWN: NOW - worked_ago}), RULES)
    assert (verdict.stalled, verdict.idle_s) == (stalled, worked_ago)


def test_the_main_thread_of_another_nodes_rank_is_not_read_here():
    """Its PID may name one of this launcher's processes, whose work says nothing of that rank."""
    state = snapshot(pid=OWN, seen=LOCAL_MAX_AGE + EPS, progressed=TIMEOUT + 30, remote=True)
    assert last_active(state, None, NOW, RULES, ours={OWN}, running={OWN}, worked_at={OWN: NOW}) == NOW - (TIMEOUT + 30)


@pytest.mark.parametrize("used, worked", [(0.75, False), (0.8, True), (0.875, True)])
def test_a_main_thread_works_from_a_tenth_of_a_core(used, worked):
    # From zero CPU seconds, so that the difference is the exact value given.
    assert main_thread_worked(ThreadCpu(100.0, 0.0), ThreadCpu(108.0, used)) is worked


def test_a_main_threads_first_reading_or_no_time_passed_judges_nothing():
    reading = ThreadCpu(100.0, 3.0)
    assert not main_thread_worked(None, reading)
    assert not main_thread_worked(reading, ThreadCpu(100.0, 4.0))


# -- exit records ---------------------------------------------------------------------------------


@pytest.mark.parametrize("ended_ago, stalled", [(TIMEOUT - EPS, False), (TIMEOUT, True)])
def test_a_rank_with_an_exit_record_counts_from_its_exit_and_is_not_alive(ended_ago, stalled):
    """Rank 1 ended (its process may not be reaped yet: the record wins); rank 0 waits for it."""
    ranks = {0: snapshot(progressed=TIMEOUT + 30), 1: snapshot(pid=OWN + 1, seen=ended_ago)}
    exits = {1: exit_record(ended_ago, pid=OWN + 1)}
    assert last_active(ranks[1], exits[1], NOW, RULES) == NOW - ended_ago
    verdict = judge(observe(ranks, exits, running={OWN, OWN + 1}), RULES)
    assert (verdict.stalled, verdict.idle_s, verdict.alive) == (stalled, ended_ago, (0,))


def test_every_rank_ended_is_no_stall():
    ranks = {0: snapshot(seen=TIMEOUT + 1), 1: snapshot(pid=OWN + 1, seen=TIMEOUT + 1)}
    exits = {0: exit_record(TIMEOUT + 1), 1: exit_record(TIMEOUT + 1, pid=OWN + 1)}
    verdict = judge(observe(ranks, exits, running={OWN, OWN + 1}), RULES)
    assert (verdict.stalled, verdict.idle_s, verdict.alive) == (False, TIMEOUT + 1, ())


# -- reading the other nodes' ranks ---------------------------------------------------------------


@pytest.mark.parametrize("idle, rank_ended, read", [
    (TIMEOUT / 2 - EPS, False, None),  # nothing to fear yet
    (TIMEOUT / 2, False, RemoteRead(TIMEOUT / 4, until_progress=False)),  # now and then, in case the store goes
    (TIMEOUT - EPS, False, RemoteRead(TIMEOUT / 4, until_progress=False)),
    (TIMEOUT, False, RemoteRead(RULES.poll_s, until_progress=True)),  # the other nodes say whether it is stuck
    (0.0, True, RemoteRead(RULES.poll_s, until_progress=False)),  # a rank here ended: the attempt may be ending
    (TIMEOUT, True, RemoteRead(RULES.poll_s, until_progress=True)),
])
def test_how_fresh_the_other_nodes_ranks_must_be(idle, rank_ended, read):
    assert remote_read(idle, rank_ended, RULES) == read


@pytest.mark.parametrize("state, answer", [
    (snapshot(pid=STRANGER, progressed=TIMEOUT - EPS, remote=True), True),
    (snapshot(pid=STRANGER, progressed=TIMEOUT, remote=True), False),
    (snapshot(pid=STRANGER, seen=REMOTE_MAX_AGE - EPS, progressed=REMOTE_MAX_AGE - EPS, remote=True), True),
    (snapshot(pid=STRANGER, seen=REMOTE_MAX_AGE, progressed=REMOTE_MAX_AGE, remote=True), False),  # stale: may be gone
    ({**snapshot(pid=STRANGER, remote=True), "exit": {"status": "finished", "time": NOW}}, False),
    (snapshot(pid=STRANGER, remote=True, agent_exit={"exitcode": 1, "signal": None}), False),
    ({"pid": STRANGER, "time": NOW, "remote": True}, False),  # never progressed
])
def test_one_progressing_rank_rules_a_stall_out(state, answer):
    assert progressing(state, NOW, RULES) is answer


# -- the rank's side: its state at each look ----------------------------------------------------


def test_busy_share_is_exact_in_binary_for_the_cases_below():
    assert BUSY_SHARE * 8.0 == 0.8  # so "at" below is at the threshold, not a rounding away from it


@pytest.mark.parametrize("used, worked", [(0.75, False), (0.8, True), (0.875, True)])
def test_a_process_tree_works_from_a_tenth_of_a_core(used, worked):
    # From zero CPU seconds, so that the difference is the exact value given.
    assert tree_worked(CpuReading(100.0, 0.0, 0.0), CpuReading(108.0, used, 0.0)) is worked


def test_a_trees_first_reading_or_no_time_passed_judges_nothing():
    reading = CpuReading(100.0, 3.0, 1.0)
    assert not tree_worked(None, reading)
    assert not tree_worked(reading, CpuReading(100.0, 9.0, 1.0))


@pytest.mark.parametrize("main_used, same_instruction, native", [
    (0.8, True, True),  # one C call: the main thread burns CPU, its instruction stays
    (0.75, True, False),  # below a tenth of a core: a wait (a sleep, a lock) is no native work
    (0.8, False, False),  # the instruction moved: Python runs
])
def test_a_native_call_is_main_thread_cpu_at_one_instruction(main_used, same_instruction, native):
    before, after = CpuReading(100.0, 0.0, 0.0), CpuReading(108.0, main_used, main_used)
    assert in_native_call(before, after, same_instruction) is native
    assert not in_native_call(None, after, same_instruction)


@pytest.mark.parametrize(
    "blocked, worked, moved, state",
    [
        (True, False, False, WAITING),  # blocked in the backend
        (True, True, False, WAITING),  # ... whatever its helpers, NCCL's threads or CUDA's spin-waits burn
        (True, False, True, WORKING),  # Python work around a collective call (DDP's construction imports modules)
        (False, True, False, WORKING),  # a native call, busy DataLoader workers, a child process
        (False, False, True, WORKING),  # Python that mostly waits on the network moves its position
        (False, True, True, WORKING),  # an endless Python loop
        (False, False, False, IDLE),  # a sleep, a lock, a queue nothing fills
    ],
)
def test_a_rank_is_waiting_working_or_idle(blocked, worked, moved, state):
    assert rank_state(blocked, worked, moved) == state


# -- the busy clock: ranks wait in a collective for a rank that works ----------------------------


def working(progressed: float, worked: float = 0.0, pid: int = OWN) -> dict:
    """A rank outside collectives whose looks last found it working `worked` s before NOW."""
    return snapshot(pid=pid, progressed=progressed, activity={"state": WORKING, "worked_at": NOW - worked})


def waiting(progressed: float, pid: int = OWN + 1) -> dict:
    return snapshot(pid=pid, progressed=progressed, activity={"state": WAITING, "worked_at": 0.0})


def busy_judge(ranks: dict) -> tuple:
    verdict = judge(observe(ranks, running={OWN, OWN + 1, OWN + 2}), RULES)
    return verdict.stalled, verdict.busy


@pytest.mark.parametrize("no_progress, busy", [
    (TIMEOUT - EPS, None),  # within the stall timeout: nothing to say
    (TIMEOUT, Busy(TIMEOUT, (0,), (1,), stop=False)),  # noted, not stopped
    (BUSY_TIMEOUT - EPS, Busy(BUSY_TIMEOUT - EPS, (0,), (1,), stop=False)),
    (BUSY_TIMEOUT, Busy(BUSY_TIMEOUT, (0,), (1,), stop=True)),  # stopped at the busy timeout
    (BUSY_TIMEOUT + EPS, Busy(BUSY_TIMEOUT + EPS, (0,), (1,), stop=True)),
])
def test_a_working_rank_others_wait_for_is_noted_at_the_stall_timeout_and_stopped_at_the_busy_timeout(no_progress, busy):
    stalled, seen = busy_judge({0: working(progressed=no_progress + 30), 1: waiting(progressed=no_progress)})
    assert (stalled, seen) == (False, busy)


@pytest.mark.parametrize("worked, stalled", [(TIMEOUT - EPS, False), (TIMEOUT, True)])
def test_a_rank_that_stopped_working_is_idle_and_stalls_at_the_stall_timeout(worked, stalled):
    """The stall clock counts from the last work as well as the last progress: an idle rank
    (a sleep, a deadlock) that others wait for is stopped at the stall timeout, as before."""
    seen_stalled, busy = busy_judge({0: working(progressed=TIMEOUT + 30, worked=worked), 1: waiting(progressed=TIMEOUT + 20)})
    assert seen_stalled is stalled
    assert (busy is None) is stalled, "busy only while the rank works"


@pytest.mark.parametrize("worked", [EPS, TIMEOUT - EPS])
def test_a_rank_that_just_stopped_working_is_not_busy_but_idle(worked):
    """It worked until `worked` s ago (past the last progress), and its latest look found it
    idle (it went to sleep, or into a lock): no note; the stall clock stops it once its last
    work is the stall timeout old."""
    sleeper = snapshot(progressed=TIMEOUT + 30, activity={"state": IDLE, "worked_at": NOW - worked})
    assert busy_judge({0: sleeper, 1: waiting(progressed=TIMEOUT + 20)}) == (False, None)


@pytest.mark.parametrize("silent_for, worked_ago, busy", [
    (LOCAL_MAX_AGE + EPS, 1.0, True),  # its writer is held up (a native call holding the GIL) while its main thread works
    (LOCAL_MAX_AGE + EPS, LOCAL_MAX_AGE + 2 * EPS, False),  # its main thread last worked before its last snapshot
])
def test_a_rank_whose_snapshots_stopped_works_by_its_main_threads_cpu(silent_for, worked_ago, busy):
    silent = snapshot(seen=silent_for, progressed=TIMEOUT + 30, activity={"state": IDLE, "worked_at": NOW - silent_for})
    verdict = judge(observe({0: silent, 1: waiting(progressed=TIMEOUT + 20)}, running={OWN, OWN + 1},
                            worked_at={OWN: NOW - worked_ago}), RULES)
    assert (verdict.busy is not None) is busy and not verdict.stalled


def test_ranks_that_all_work_and_none_waits_are_not_busy():
    """Every rank computing away from collectives (preprocessing, each its own evaluation) is
    healthy however long it lasts: nobody waits."""
    stalled, busy = busy_judge({0: working(progressed=BUSY_TIMEOUT + 30), 1: working(progressed=BUSY_TIMEOUT + 30, pid=OWN + 1)})
    assert (stalled, busy) == (False, None)


def test_one_rank_that_progresses_rules_the_busy_clock_out():
    ranks = {0: working(progressed=BUSY_TIMEOUT + 30), 1: waiting(progressed=BUSY_TIMEOUT + 30),
             2: snapshot(pid=OWN + 2, progressed=TIMEOUT - EPS, activity={"state": WORKING, "worked_at": NOW})}
    assert busy_judge(ranks) == (False, None)


def test_the_busy_clock_names_every_working_and_waiting_rank():
    ranks = {0: working(progressed=TIMEOUT + 30), 1: waiting(progressed=TIMEOUT),
             2: snapshot(pid=OWN + 2, progressed=TIMEOUT + 5, activity={"state": WAITING})}
    verdict = judge(observe(ranks, running={OWN, OWN + 1, OWN + 2}), RULES)
    assert verdict.busy == Busy(TIMEOUT, (0,), (1, 2), stop=False)
    assert verdict.progress_idle_s == TIMEOUT and verdict.idle_s == 0.0
    assert "rank(s) 0 work and rank(s) 1, 2 wait" in verdict.reason


def test_real_progress_is_the_exit_or_the_last_progress_never_the_work():
    state = working(progressed=TIMEOUT + 30)
    assert last_progressed(state, None, NOW, RULES, ours={OWN}, running={OWN}) == NOW - (TIMEOUT + 30)
    assert last_active(state, None, NOW, RULES, ours={OWN}, running={OWN}) == NOW
    assert last_progressed(state, exit_record(3.0), NOW, RULES) == NOW - 3.0


def idle_outside(progressed: float, pid: int = OWN) -> dict:
    """A rank outside every collective that did nothing since `progressed` s before NOW (a main
    thread waiting on its DataLoader's workers, a lock, a subprocess)."""
    return snapshot(pid=pid, progressed=progressed, activity={"state": IDLE, "worked_at": 0.0})


@pytest.mark.parametrize("no_progress, busy", [
    (TIMEOUT - EPS, None),  # within the stall timeout: nothing to say
    (TIMEOUT, Busy(TIMEOUT, (), (), stop=False, outside=(0, 1))),  # not stalled: noted
    (BUSY_TIMEOUT - EPS, Busy(BUSY_TIMEOUT - EPS, (), (), stop=False, outside=(0, 1))),
    (BUSY_TIMEOUT, Busy(BUSY_TIMEOUT, (), (), stop=True, outside=(0, 1))),  # stopped at the busy timeout
])
def test_ranks_idle_outside_every_collective_are_no_communication_hang_and_wait_for_the_busy_timeout(no_progress, busy):
    """Nobody waits on a peer: the stall timeout does not stop the job, the busy timeout does."""
    seen = judge(observe({0: idle_outside(no_progress), 1: idle_outside(no_progress + 5, pid=OWN + 1)},
                         running={OWN, OWN + 1}), RULES)
    assert (seen.stalled, seen.busy) == (False, busy)
    if busy is not None:
        assert "none waits in a collective" in seen.reason


def test_one_rank_waiting_in_a_collective_makes_it_a_stall_again():
    """The peer the waiting rank needs is idle elsewhere: a communication hang, at the stall timeout."""
    seen = judge(observe({0: idle_outside(TIMEOUT), 1: waiting(TIMEOUT)}, running={OWN, OWN + 1}), RULES)
    assert (seen.stalled, seen.busy) == (True, None)


def test_a_rank_whose_looks_said_nothing_may_be_waiting_and_keeps_the_stall_clock():
    """A snapshot without the state of its looks (an older gradsync): it may wait in a collective."""
    unknown = snapshot(progressed=TIMEOUT, pid=OWN + 1)
    del unknown["activity"]
    seen = judge(observe({0: idle_outside(TIMEOUT), 1: unknown}, running={OWN, OWN + 1}), RULES)
    assert (seen.stalled, seen.busy) == (True, None)


def test_a_rank_whose_records_hold_an_unfinished_collective_waits_in_it_whatever_its_looks_say():
    """The end of a backward waiting for DDP's bucket reductions: native code, no CPU, looks idle."""
    in_backward = idle_outside(TIMEOUT, pid=OWN + 1)
    in_backward["records"] = [{"state": "finished"}, {"state": "issued"}]
    seen = judge(observe({0: idle_outside(TIMEOUT), 1: in_backward}, running={OWN, OWN + 1}), RULES)
    assert (seen.stalled, seen.busy) == (True, None)
