"""The launcher's monitor on a run folder several nodes share (a shared file system): it sees every
node's ranks, diagnoses them all, and stops only the processes its own launcher started."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from gradsync.run import launcher
from gradsync.run.launcher import _another_node_writes
from gradsync.run.monitor import Monitor, _main_thread_cpu_s, pid_alive
from gradsync.run.options import RunOptions
from gradsync.rundir import RunDir, write_json
from gradsync.rundir.io import RingWriter
from gradsync.rundir.records import RECORD_FIELDS

NOW = 1_000_000.0  # the time the monitor judges at (its clock), whatever the test's own pace


def _not_our_descendant() -> psutil.Process:
    """A process of this machine that this test did not start as a child (re-parented to init),
    standing in for the PID another node's snapshot names. It blocks every signal it can, so a
    signal sent to it stays pending where the test can see it (SIGKILL cannot be blocked, and
    gradsync sends it only after a SIGTERM)."""
    parent = subprocess.run(
        [sys.executable, "-c", "import signal, subprocess, sys\n"
         "signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP})\n"
         "print(subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
         "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)"],
        capture_output=True, text=True, check=True,
    )
    return psutil.Process(int(parent.stdout))


def _signals_sent_to(pid: int) -> int:
    """The signals sent to `pid` and still pending (all of them, for a process that blocks them), as a bit mask."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(status["SigPnd"], 16) | int(status["ShdPnd"], 16)


def _snapshot(rank: int, pid: int, now: float) -> dict:
    return {
        "rank": rank, "local_rank": rank, "world_size": 2, "local_world_size": 1, "attempt": 0, "host": "other",
        "pid": pid, "started": now - 60, "target": "train.py", "time": now, "phase": "running",
        "last_progress": now - 30, "groups": {}, "stack": [], "location": "train.py:9", "backward_passes": 1,
    }


@pytest.mark.launches
def test_a_stall_seen_in_a_shared_folder_stops_no_process_of_another_node(tmp_path):
    stranger = _not_our_descendant()
    try:
        run = RunDir(tmp_path)
        for rank in (0, 1):
            write_json(run.snapshot(0, rank), _snapshot(rank, stranger.pid, NOW))
        reports = []
        monitor = Monitor(RunOptions(run_dir=tmp_path, stall_timeout_s=5), lambda diagnosis, _: reports.append(diagnosis),
                          clock=lambda: NOW)
        monitor.poll()
        assert [d["trigger"] for d in reports] == ["stall"], "the other node's ranks are diagnosed"
        assert monitor.stopped_pids == set()
        assert _signals_sent_to(stranger.pid) == 0, "and never signalled from here"
        assert stranger.is_running() and stranger.status() != psutil.STATUS_ZOMBIE
    finally:
        stranger.kill()


def test_a_relaunch_keeps_the_records_another_node_is_writing(tmp_path, monkeypatch):
    """Another node rewrites its snapshot while the launcher watches (its wait stands in for the
    time the other node takes: no thread racing the clock). With a 10 s interval, records count
    as quiet for long after 31 s: this test's steps are milliseconds apart (>= 5x within it)."""
    run = RunDir(tmp_path)
    snapshot = run.snapshot(0, 1)
    write_json(snapshot, {"rank": 1})

    def other_node_writes(seconds: float) -> None:
        rewritten = snapshot.stat().st_mtime + 1  # newer than the launcher saw, whatever the file system's time granularity
        write_json(snapshot, {"rank": 1, "time": rewritten})
        os.utime(snapshot, (rewritten, rewritten))

    monkeypatch.setattr(launcher.time, "sleep", other_node_writes)
    assert _another_node_writes(run, interval_s=10)
    monkeypatch.setattr(launcher.time, "sleep", lambda seconds: None)  # the other node no longer writes
    assert not _another_node_writes(run, interval_s=10), "an earlier launch that stopped writing is not live"
    old = snapshot.stat().st_mtime - 600
    os.utime(snapshot, (old, old))
    monkeypatch.setattr(launcher.time, "sleep", other_node_writes)
    assert not _another_node_writes(run, interval_s=10), "records quiet for long are an earlier launch's: not even watched"


@pytest.mark.launches
def test_a_console_that_cannot_be_written_still_stops_the_stalled_workers(tmp_path):
    # `gradsync run ... | head` closes the console: printing the diagnosis fails, and the stuck
    # workers must be stopped all the same (else they wait for the backend's 30-minute timeout).
    workers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:
        run = RunDir(tmp_path)
        for rank, worker in enumerate(workers):
            write_json(run.snapshot(0, rank), _snapshot(rank, worker.pid, NOW))

        def report(diagnosis, _):
            raise BrokenPipeError(32, "Broken pipe")

        Monitor(RunOptions(run_dir=tmp_path, stall_timeout_s=5), report, clock=lambda: NOW).poll()
        # poll() returns once the workers are gone: a sleeping process ends on SIGTERM within
        # milliseconds, and gradsync waits GRACE_S (3 s, >= 5x) before it would SIGKILL them (-9).
        # Their exit status is then there at once; the 10 s wait is a hang detector.
        assert [worker.wait(timeout=10) for worker in workers] == [-15, -15]
    finally:
        for worker in workers:
            worker.kill()


@pytest.mark.launches
def test_a_worker_that_ended_unreaped_is_not_running_and_stalls_nothing(tmp_path):
    """A worker killed before it left an exit record, that its agent has not reaped yet (a
    zombie), is no longer running: its snapshot, fresh but idle past the stall timeout, is no stall.
    Counted as running (the PID exists), it would be one."""
    worker = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        os.waitid(os.P_PID, worker.pid, os.WEXITED | os.WNOWAIT)  # it has exited; not reaped
        assert pid_alive(os.getpid()) and not pid_alive(worker.pid)
        write_json(RunDir(tmp_path).snapshot(0, 0), {**_snapshot(0, worker.pid, NOW), "world_size": 1})
        reports = []
        Monitor(RunOptions(run_dir=tmp_path, stall_timeout_s=5), lambda diagnosis, _: reports.append(diagnosis),
                clock=lambda: NOW).poll()
        assert reports == []
    finally:
        worker.wait()


def test_workers_that_died_before_reporting_print_failed_not_ok():
    from gradsync.run.publish import render

    text = render({"status": "failed", "trigger": "failure", "findings": [], "ranks": {},
                   "note": "no worker reported: they failed before the recorder started (see their output above)"})
    assert text.startswith("gradsync run: FAILED: no worker reported"), text



@pytest.mark.launches
@pytest.mark.parametrize("spins", [True, False])
def test_a_rank_whose_snapshots_stopped_is_not_stalled_while_its_main_thread_works(tmp_path, spins):
    """A rank's snapshot writer can be held up while the rank works (seen under load: both ranks of
    a healthy job silent for 8 s while DDP's construction imported modules); the monitor then
    reads the rank's main thread from /proc. Its clock moves 3 s between two polls (a 2 s stall
    timeout: snapshots count as stale after 2.2 s), and between them the test lets the spinning
    worker use 0.9 s of CPU, whatever the machine's load: 30% of a core by that clock, 3x the
    threshold. The sleeping one uses none and is stalled."""
    code = "while True: pass" if spins else "import time; time.sleep(60)"
    worker = subprocess.Popen([sys.executable, "-c", code])
    try:
        written = {**_snapshot(0, worker.pid, NOW), "world_size": 1, "last_progress": NOW}
        write_json(RunDir(tmp_path).snapshot(0, 0), written)  # then never again
        clock = [NOW]
        reports = []
        monitor = Monitor(RunOptions(run_dir=tmp_path, stall_timeout_s=2), lambda diagnosis, _: reports.append(diagnosis),
                          clock=lambda: clock[0])
        monitor.poll()  # fresh: no stall; the main thread's first reading
        assert reports == []
        if spins:
            started, deadline = _main_thread_cpu_s(worker.pid), time.monotonic() + 120  # a hang guard only
            while _main_thread_cpu_s(worker.pid) - started < 0.9:
                assert time.monotonic() < deadline, "the spinning worker got no CPU in 120 s"
                time.sleep(0.05)
        clock[0] += 3.0
        monitor.poll()
        assert [d["trigger"] for d in reports] == ([] if spins else ["stall"])
    finally:
        worker.kill()
        worker.wait()


@pytest.mark.launches
def test_a_rank_that_works_while_the_other_waits_is_noted_then_stopped_at_the_busy_timeout(tmp_path, capsys):
    """Rank 0 works (its looks say so, at the loop of train.py:23) and rank 1 waits in an
    all_reduce: at the stall timeout a note is printed and nothing is stopped; at the busy
    timeout both are stopped and the verdict names rank 0 at its loop. Two sleeping processes
    stand in for the ranks; the monitor's clock is the test's."""
    workers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:
        run = RunDir(tmp_path)
        progressed = NOW - 6.0  # the last collective, past the 5 s stall timeout

        def write(now: float, progressed: float = progressed) -> None:
            position = {"location": "train.py:17", "loop": "train.py:23", "moved": True, "since": progressed,
                        "still_since": now - 1, "looks": 6}
            write_json(run.snapshot(0, 0), {
                **_snapshot(0, workers[0].pid, now), "last_progress": progressed, "location": "train.py:17",
                "activity": {"state": "working", "worked_at": now - 0.5, "working_since": progressed, "cpu_share": 1.0,
                             "native_call": False, "position": position}})
            write_json(run.snapshot(0, 1), {
                **_snapshot(1, workers[1].pid, now), "last_progress": progressed, "location": "train.py:40",
                "activity": {"state": "waiting", "worked_at": 0.0}})

        ring = RingWriter(run.ring(0, 1), slots=16)  # rank 1 waits in its first collective
        fields = {**dict.fromkeys(RECORD_FIELDS), "index": 0, "group": "default", "seq": 1, "op": "all_reduce",
                  "signature": "float32[1]", "site": "train.py:40", "state": "entered", "entered": progressed}
        ring.write(SimpleNamespace(**fields, ring_prefix=None))
        clock = [NOW]
        reports = []
        monitor = Monitor(RunOptions(run_dir=tmp_path, stall_timeout_s=5, busy_timeout_s=12),
                          lambda diagnosis, _: reports.append(diagnosis), clock=lambda: clock[0])
        write(clock[0])
        monitor.poll()
        monitor.poll()  # once per spell
        assert reports == [] and all(worker.poll() is None for worker in workers), "working: not stopped"
        notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("gradsync run: note:")]
        assert len(notes) == 1 and "rank 0 works at train.py:17, within the loop at train.py:23" in notes[0], notes
        assert "rank 1 waits in all_reduce #1 (float32[1]) at train.py:40" in notes[0], notes
        # A progress that leaves the same ranks at the same lines (a peer that entered its wait late,
        # on a loaded machine) starts a new spell of the same situation: not said again.
        progressed += 3.0
        clock[0] = progressed + 5.5
        write(clock[0], progressed)
        monitor.poll()
        assert not [line for line in capsys.readouterr().err.splitlines() if line.startswith("gradsync run: note:")]
        clock[0] = progressed + 12.0
        write(clock[0], progressed)
        monitor.poll()
        (diagnosis,) = reports
        (finding,) = [f for f in diagnosis["findings"] if f["severity"] == "error"]
        assert (finding["category"], finding["ranks"], finding["locations"]["0"]) == ("rank_stuck", [0], "train.py:23")
        assert "its Python position moving" in finding["message"], finding
        assert (diagnosis["stopped_at"], diagnosis["busy_timeout_s"], len(diagnosis["notes"])) == ("busy_timeout", 12, 1)
        # Stopped: SIGTERM ends a sleeping process within milliseconds; 10 s is a hang guard.
        assert [worker.wait(timeout=10) for worker in workers] == [-15, -15]
    finally:
        for worker in workers:
            worker.kill()


# Both ranks' main threads wait on their DataLoader's workers, which take 6 s to open their shards
# (sleeping, not computing), before the first collective: nobody waits on a peer.
SLOW_SHARDS = """\
import json, time
import torch, torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
class Shards(Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, index):
        time.sleep(SLEEP_S)              # line 8: opening a shard
        return torch.ones(2)
def main():
    dist.init_process_group("gloo")
    for batch in DataLoader(Shards(), batch_size=2, num_workers=1):   # line 12
        COLLECTIVE
    dist.destroy_process_group()
main()
"""


def _gradsync_run(tmp_path: Path, script: str, *options: str) -> tuple[subprocess.CompletedProcess, dict]:
    import json

    (tmp_path / "train.py").write_text(script)
    done = subprocess.run([sys.executable, "-m", "gradsync", "run", "--standalone", "--nproc-per-node", "2", *options,
                           "--run-dir", "run", "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=180)
    return done, json.loads((tmp_path / "run" / "diagnosis.json").read_text())


@pytest.mark.launches
def test_ranks_waiting_on_their_own_dataloader_workers_are_noted_not_stopped_at_the_stall_timeout(tmp_path):
    # No collective after the loader: the ranks' workers finish seconds apart on a loaded machine,
    # and a rank that reached an all_reduce first would rightly make it a stall.
    done, diagnosis = _gradsync_run(tmp_path, SLOW_SHARDS.replace("SLEEP_S", "6").replace("COLLECTIVE", "batch.sum()"),
                                    "--stall-timeout", "2")
    assert done.returncode == 0 and diagnosis["status"] == "ok", done.stderr
    assert "no rank is in a collective" in done.stderr and "Nobody waits on a peer" in done.stderr
    assert "waiting on its DataLoader's worker processes" in done.stderr


@pytest.mark.launches
def test_ranks_that_never_leave_their_own_waits_are_stopped_at_the_busy_timeout_as_stalled_outside_collectives(tmp_path):
    done, diagnosis = _gradsync_run(tmp_path, SLOW_SHARDS.replace("SLEEP_S", "120").replace("COLLECTIVE", "dist.all_reduce(batch)"),
                                    "--stall-timeout", "2", "--busy-timeout", "6")
    assert done.returncode == 1, done.stderr
    (finding,) = [f for f in diagnosis["findings"] if f["severity"] == "error"]
    assert finding["category"] == "stalled_outside_collectives" and finding["ranks"] == [0, 1], finding
    assert finding["locations"] == {"0": "train.py:12", "1": "train.py:12"}
    assert diagnosis["stopped_at"] == "busy_timeout"
