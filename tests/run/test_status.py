"""`gradsync status` and `gradsync stacks`: a running job's ranks and their threads' stacks, read
from outside the job, on one host and across two simulated hosts (the other node's ranks through
the rendezvous store).

The launches judge what the commands say about where each rank is, never how fast anything ran:
each waits (with a generous bound) until the job has reached the state it asks about, then reads."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from gradsync.bench.cluster import ClusterSpec, SimulatedCluster
from gradsync.distributed import free_port
from gradsync.errors import ConfigError
from gradsync.run.jobwide import JobBoard, StoreAddress
from gradsync.run.stacks import HOLD_S, RequestWatch, StacksRequest, thread_stacks
from gradsync.run.status import JobState, job_line, newest_run, rank_status, read_job, status_lines, statuses
from gradsync.rundir import RunDir
from tests.harness import REPO_ROOT
from tests.run.test_outside import HOLDS_THE_GIL

BIN = Path(sys.executable).parent
JOB = REPO_ROOT / "tests/run/status_job.py"
# Hang detectors only: the jobs below take 10-30 s here; the bounds are several times that.
REACHED_S = 120
JOB_S = 240


def _line(marker: str) -> str:
    number = next(i for i, line in enumerate(JOB.read_text().splitlines(), 1) if line.rstrip().endswith(f"# status: {marker}"))
    return f"status_job.py:{number}"


# -- what a rank's state says, on hand-built states --------------------------------------------------


def _state(rank: int, now: float, **extra) -> dict:
    return {"rank": rank, "world_size": 2, "host": f"host{rank}", "pid": 100 + rank, "started": now - 30, "time": now,
            "last_progress": now - 2, "location": "train.py:30", "optimizer_steps": 12, "step_time_s": 0.25,
            "rss_mb": 512.0, "communication_wait_s": 0.5, "activity": {"state": "working", "cpu_share": 0.97},
            "records": [], **extra}


def _waiting(now: float, seq: int = 57) -> dict:
    return {"index": seq - 1, "group": "default", "seq": seq, "op": "all_reduce", "signature": "float32[9]", "kind": "",
            "site": "train.py:42", "state": "entered", "entered": now - 3, "finished": None, "crc": None, "error": None}


def test_a_rank_is_waiting_in_its_collective_working_or_idle_at_its_line_or_ended():
    now = 1000.0
    waiting = rank_status(0, _state(0, now, records=[_waiting(now)], activity={"state": "waiting", "cpu_share": 0.01}), now)
    assert waiting.state == "waiting in all_reduce #57 (float32[9]) at train.py:42 for 3 s"
    assert waiting.waiting_in == ("default", 57) and waiting.cpu_percent == pytest.approx(1.0)
    working = rank_status(1, _state(1, now), now)
    assert working.state == "working at train.py:30" and working.step == 12 and working.step_time_s == 0.25
    assert working.since_progress_s == pytest.approx(2.0) and working.rss_mb == 512.0
    silent = rank_status(1, _state(1, now - 30), now)
    assert silent.state == "not heard of for 30 s; last at train.py:30"
    ended = rank_status(1, _state(1, now, exit={"status": "exception", "type": "ValueError", "location": "train.py:9"}), now)
    assert ended.state == "ended: failed with ValueError at train.py:9" and ended.since_progress_s is None
    assert rank_status(0, _state(0, now, exit={"status": "finished", "code": 0}), now).state == "ended: finished"
    held = _state(0, now, ending={"status": "finished", "code": 0, "time": now - 5,
                                  "threads": [{"thread": "beat", "at": "train.py:17", "started_at": "train.py:27", "stack": []}]})
    assert rank_status(0, held, now).state == ("script ended, exit held: its process waits for its non-daemon thread "
                                               "'beat' (started at train.py:27), at train.py:17")


def test_the_job_line_names_the_slowest_rank_and_who_waits_for_whom():
    now = 1000.0
    states = {0: _state(0, now, records=[_waiting(now)], communication_wait_s=9.0),
              1: _state(1, now, communication_wait_s=0.2, location="train.py:18")}
    job = JobState(Path("."), 0, states, now)
    line = job_line(job, statuses(job))
    assert line.startswith("job running: 2 ranks, attempt 0 | slowest rank 1 (it waited 0.2 s for the others, rank 0 9.0 s)")
    assert line.endswith("rank 0 waits in collective #57 for rank 1 (rank 1 working at train.py:18)")
    # Waits alike: no slowest rank is named.
    alike = JobState(Path("."), 0, {0: _state(0, now), 1: _state(1, now)}, now)
    assert "slowest" not in job_line(alike, statuses(alike))
    ended = JobState(Path("."), 0, {r: _state(r, now, exit={"status": "finished"}) for r in (0, 1)}, now, {"status": "ok"})
    assert ended.ended and job_line(ended, statuses(ended)).startswith("job ended (last known state; diagnosis: ok)")
    lines = status_lines(ended)
    assert len(lines) == 3 and lines[1].startswith("  rank 0 | host0 pid 100 | ended: finished | step 12 | 0.25 s/step")



@pytest.mark.launches
def test_a_rank_of_this_host_whose_reports_stopped_is_read_from_outside(tmp_path):
    # Its main thread holds the GIL in a C call: its own reports stop, py-spy reads its line.
    (tmp_path / "hold.py").write_text(HOLDS_THE_GIL)
    held = subprocess.Popen([sys.executable, "hold.py"], cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    try:
        assert held.stdout.readline().strip() == "ready"
        time.sleep(0.5)  # into the C call
        run = RunDir(tmp_path / "run")
        run.attempt(0).mkdir(parents=True)
        now = time.time()
        state = _state(0, now - 20, host=socket.gethostname(), pid=held.pid, cwd=str(tmp_path), location="hold.py:5")
        run.snapshot(0, 0).write_text(json.dumps(state))
        (line,) = [r.state for r in statuses(read_job(run.root, now=lambda: now, read_silent=True))]
        # A stacks request's polls read the folder alone: no py-spy at each of them.
        (unread,) = [r.state for r in statuses(read_job(run.root, now=lambda: now))]
        assert unread == "not heard of for 20 s; last at hold.py:5", unread
    finally:
        held.kill()
        held.wait()
    assert line.startswith("not heard of for 20 s; read from outside: at hold.py:3 (read from outside by py-spy"), line
    assert "its main thread held the GIL" in line, line
    # A rank of another host, or one whose process is gone, shows its last report.
    assert rank_status(0, _state(0, now - 20), now).state == "not heard of for 20 s; last at train.py:30"

def test_the_newest_run_folder_is_the_default_and_a_folder_without_workers_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="no run of `gradsync run` under"):
        newest_run(tmp_path)
    for name in ("old", "new"):
        RunDir(tmp_path / name).attempt(0).mkdir(parents=True)
        time.sleep(0.01)
    (tmp_path / "not-a-run").mkdir()
    assert newest_run(tmp_path).name == "new"
    with pytest.raises(ConfigError, match="no worker of `gradsync run` has started there yet"):
        read_job(tmp_path / "not-a-run")


def test_a_request_is_answered_for_a_while_and_read_again_only_when_it_changes(tmp_path):
    path = tmp_path / "stacks-request.json"
    watch = RequestWatch(path)
    assert watch.current(time.time()) is None  # no request yet
    request = StacksRequest("abc", 1000.0)
    request.write(path)
    assert watch.current(1000.0 + HOLD_S) == request and watch.current(1000.0 + HOLD_S + 1) is None
    path.write_text("not json")
    os.utime(path, (2000.0, 2000.0))
    assert watch.current(1000.0) is None, "a damaged request asks nothing"


def test_every_threads_stack_is_listed_the_main_thread_first_and_the_asker_left_out():
    release = threading.Event()
    helper = threading.Thread(target=release.wait, name="helper", daemon=True)
    helper.start()
    answers: list = []
    asker = threading.Thread(target=lambda: answers.append(thread_stacks(leave_out=threading.get_ident())), name="asker")
    try:
        asker.start()
        asker.join()
    finally:
        release.set()
    (threads,) = answers
    names = [t["thread"] for t in threads]
    assert names[0] == "MainThread" and threads[0]["main"] and "helper" in names and "asker" not in names
    helper_stack = next(t for t in threads if t["thread"] == "helper")["stack"]
    assert helper_stack[-1].endswith("in wait"), helper_stack  # Event.wait's innermost frame, in threading.py


def test_a_request_reaches_every_node_through_the_store():
    server = TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=5), wait_for_workers=False, multi_tenant=True)
    address = StoreAddress("127.0.0.1", server.port, "job-1")
    asking, relaying = JobBoard(address, 1.0), JobBoard(address, 1.0)
    assert relaying.stacks_request() is None
    assert asking.request_stacks("r1")
    assert relaying.stacks_request() == "r1"
    del server


# -- real jobs ---------------------------------------------------------------------------------------


def _launch(run_dir: Path, *job_args: str, stall_timeout: int = 60) -> subprocess.Popen:
    return subprocess.Popen(
        [str(BIN / "gradsync"), "run", "--standalone", "--nproc-per-node", "2", "--run-dir", str(run_dir),
         "--stall-timeout", str(stall_timeout), str(JOB), *job_args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _status(run_dir: Path) -> list[str]:
    done = subprocess.run([str(BIN / "gradsync"), "status", str(run_dir)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.splitlines()


def _until(condition, what: str, bound_s: float = REACHED_S):
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.3)
    raise AssertionError(f"not reached within {bound_s} s: {what}")


def _ranks_at_step(run_dir: Path, step: int):
    def reached():
        try:
            job = read_job(run_dir)
        except ConfigError:
            return None
        ranks = statuses(job)
        return ranks if len(ranks) == 2 and all((r.step or 0) >= step for r in ranks) else None
    return reached


@pytest.mark.launches
@pytest.mark.timeout(JOB_S + 60)
def test_status_names_the_slow_rank_then_the_hang_and_stacks_name_each_ranks_line(tmp_path):
    run_dir, mark, release = tmp_path / "run", tmp_path / "hanging", tmp_path / "release"
    # Held until released (50 s at most, under the 60 s stall timeout): the reads below may take long on a busy machine.
    job = _launch(run_dir, "--steps", "24", "--slow-rank", "1", "--delay", "0.3", "--hang-at", "14", "--hang-s", "50",
                  "--mark", str(mark), "--release", str(release))
    try:
        # 10 steps of 0.3 s: rank 0 has waited 3 s more than rank 1, over 5% of even a slow start-up.
        _until(_ranks_at_step(run_dir, 10), "both ranks past step 10")
        head = _status(run_dir)[0]
        assert head.startswith("job running: 2 ranks, attempt 0") and "slowest rank 1 (it waited" in head, head
        # Rank 1 stops before its stall timeout: rank 0 waits in the step's all-reduce for it.
        _until(mark.exists, "rank 1 hanging")
        time.sleep(3)
        lines = _status(run_dir)
        assert "rank 0 waits in collective #" in lines[0] and "for rank 1 (rank 1 idle at" in lines[0], lines
        rank0, rank1 = lines[1], lines[2]
        assert "waiting in all_reduce #" in rank0 and f"{_line('backward')} for " in rank0, rank0
        assert "| idle at " in rank1 and f"{_line('hang')} |" in rank1, rank1  # asleep: no CPU, its line still
        assert "progress" in rank1 and not rank1.endswith("progress 0 s ago"), "its last progress was seconds ago"
        stacks = subprocess.run([str(BIN / "gradsync"), "stacks", str(run_dir)], capture_output=True, text=True, timeout=60)
        assert stacks.returncode == 0, stacks.stdout + stacks.stderr
        text = stacks.stdout
        assert text.index("rank 0 (") < text.index("rank 1 (")
        rank0_stack, rank1_stack = text.split("rank 1 (")
        assert _line("backward") + " in main" in rank0_stack and _line("hang") + " in main" in rank1_stack, text
        assert "thread 'MainThread' (main):" in rank1_stack
    finally:
        release.touch()
        output, _ = job.communicate(timeout=JOB_S)
    assert job.returncode == 0, output
    lines = _status(run_dir)
    assert lines[0].startswith("job ended (last known state; diagnosis: ok)"), lines
    assert all("ended: finished | step 24" in line for line in lines[1:]), lines


@pytest.mark.launches
@pytest.mark.timeout(JOB_S + 60)
@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install tmux)")
def test_status_watch_draws_a_live_table_in_a_terminal_until_the_job_ends(tmp_path):
    run_dir, session = tmp_path / "run", f"gradsync-status-{os.getpid()}"
    job = _launch(run_dir, "--steps", "300")  # 15 s or more: still running when the pane's first table is drawn
    try:
        _until(_ranks_at_step(run_dir, 3), "both ranks past step 3")
        subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "220", "-y", "30",
                        # pytest's COLUMNS=80 would hold the pane's program to 80 columns: the pane's own size instead.
                        f"env -u COLUMNS -u LINES {BIN / 'gradsync'} status --watch {run_dir}; echo WATCH-ENDED; sleep 60"],
                       check=True)

        def screen_with(text: str):
            def shown() -> str | None:
                screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout
                return screen if text in screen else None
            return shown

        live = _until(screen_with("job running: 2 ranks"), "the live table")
        assert all(word in live for word in ("rank", "state", "s/step", "CPU", "RSS", "progress")), live
        assert "┃" in live or "│" in live, "a table, drawn"
        healthy_head = next(line for line in live.splitlines() if "job running" in line)
        assert "slowest" not in healthy_head, "ranks that wait alike name no slowest rank"
        ended = _until(screen_with("WATCH-ENDED"), "--watch ends with the job", JOB_S)
        assert "job ended (last known state" in ended and "ended: finished" in ended, ended
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
        output, _ = job.communicate(timeout=JOB_S)
    assert job.returncode == 0, output


@pytest.mark.launches
@pytest.mark.timeout(JOB_S + 60)
def test_on_two_hosts_status_and_stacks_read_the_other_hosts_rank_through_the_store(needs_cluster, tmp_path):
    port, mark, release = free_port(), tmp_path / "hanging", tmp_path / "release"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with SimulatedCluster(ClusterSpec(hosts=2)) as cluster:
        launchers = []
        for host in range(2):
            argv = [sys.executable, "-m", "gradsync", "run", *cluster.torchrun_args(host, nproc_per_node=1, master_port=port),
                    "--stall-timeout", "60", "--run-dir", str(tmp_path / f"host{host}"), str(JOB),
                    "--steps", "16", "--slow-rank", "1", "--hang-at", "8", "--hang-s", "50", "--mark", str(mark),
                    "--release", str(release)]
            launchers.append(cluster.run(host, argv, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         text=True))
        try:
            _until(mark.exists, "rank 1 hanging on host 1")
            time.sleep(3)
            host0 = tmp_path / "host0"
            assert not list(host0.glob("workers/attempt0/rank1*")), "no shared folder: host 0 has only its own rank"

            def on_host0(*command: str) -> str:
                reader = cluster.run(0, [str(BIN / "gradsync"), *command, str(host0)], env=env, cwd=tmp_path,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                return reader.communicate(timeout=60)[0]

            status = on_host0("status").splitlines()
            assert len(status) == 3 and "rank 0 waits in collective #" in status[0] and "for rank 1" in status[0], status
            assert status[2].startswith("  rank 1 |") and f"{_line('hang')} |" in status[2], status
            stacks = on_host0("stacks")
            assert "rank 1 (" in stacks and _line("hang") + " in main" in stacks.split("rank 1 (")[1], stacks
        finally:
            release.touch()
            outputs = [launcher.communicate(timeout=JOB_S)[0] for launcher in launchers]
    assert [launcher.returncode for launcher in launchers] == [0, 0], outputs
