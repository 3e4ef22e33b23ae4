"""The launcher's monitor on a run folder several nodes share (a shared file system): it sees every
node's ranks, diagnoses them all, and stops only the processes its own launcher started."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import psutil

from gradsync.run.launcher import _another_node_writes
from gradsync.run.monitor import Monitor
from gradsync.run.options import RunOptions
from gradsync.rundir import RunDir, write_json


def _not_our_descendant() -> psutil.Process:
    """A process of this machine that this test did not start as a child (re-parented to init),
    standing in for the PID another node's snapshot names."""
    launcher = subprocess.run(
        [sys.executable, "-c", "import subprocess, sys; print(subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
         "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)"],
        capture_output=True, text=True, check=True,
    )
    return psutil.Process(int(launcher.stdout))


def _snapshot(rank: int, pid: int, now: float) -> dict:
    return {
        "rank": rank, "local_rank": rank, "world_size": 2, "local_world_size": 1, "attempt": 0, "host": "other",
        "pid": pid, "started": now - 60, "target": "train.py", "time": now, "phase": "running",
        "last_progress": now - 30, "groups": {}, "stack": [], "location": "train.py:9", "backward_passes": 1,
    }


def test_a_stall_seen_in_a_shared_folder_stops_no_process_of_another_node(tmp_path):
    stranger = _not_our_descendant()
    try:
        run = RunDir(tmp_path)
        now = time.time()
        for rank in (0, 1):
            write_json(run.snapshot(0, rank), _snapshot(rank, stranger.pid, now))
        reports = []
        monitor = Monitor(RunOptions(run_dir=tmp_path, stall_timeout_s=5), lambda diagnosis, _: reports.append(diagnosis))
        monitor.poll()
        assert [d["trigger"] for d in reports] == ["stall"], "the other node's ranks are diagnosed"
        assert monitor.stopped_pids == set()
        time.sleep(0.5)
        assert stranger.is_running() and stranger.status() != psutil.STATUS_ZOMBIE, "and never signalled from here"
    finally:
        stranger.kill()


def test_a_relaunch_keeps_the_records_another_node_is_writing(tmp_path):
    run = RunDir(tmp_path)
    snapshot = run.snapshot(0, 1)
    write_json(snapshot, {"rank": 1})
    stop = threading.Event()

    def other_node():
        while not stop.wait(0.1):
            write_json(snapshot, {"rank": 1, "time": time.time()})

    writer = threading.Thread(target=other_node)
    writer.start()
    try:
        assert _another_node_writes(run, interval_s=0.2)
    finally:
        stop.set()
        writer.join()
    assert not _another_node_writes(run, interval_s=0.2), "an earlier launch that stopped writing is not live"
    old = time.time() - 600
    os.utime(snapshot, (old, old))
    assert not _another_node_writes(run, interval_s=0.2)


def test_a_console_that_cannot_be_written_still_stops_the_stalled_workers(tmp_path):
    # `gradsync run ... | head` closes the console: printing the diagnosis fails, and the stuck
    # workers must be stopped all the same (else they wait for the backend's 30-minute timeout).
    workers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:
        run = RunDir(tmp_path)
        now = time.time()
        for rank, worker in enumerate(workers):
            write_json(run.snapshot(0, rank), _snapshot(rank, worker.pid, now))

        def report(diagnosis, _):
            raise BrokenPipeError(32, "Broken pipe")

        Monitor(RunOptions(run_dir=tmp_path, stall_timeout_s=5), report).poll()
        assert [worker.wait(timeout=10) for worker in workers] == [-15, -15]
    finally:
        for worker in workers:
            worker.kill()


def test_workers_that_died_before_reporting_print_failed_not_ok():
    from gradsync.run.publish import render

    text = render({"status": "failed", "trigger": "failure", "findings": [], "ranks": {},
                   "note": "no worker reported: they failed before the recorder started (see their output above)"})
    assert text.startswith("gradsync run: FAILED: no worker reported"), text
