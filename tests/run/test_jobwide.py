"""The job-wide view (gradsync.run.jobwide): each node's launcher publishes its ranks' compact state
through the rendezvous store and reads the other nodes' ranks, so every node's verdict names them.

Unit tests talk to a real TCPStore on localhost; the last tests run `gradsync run` on two simulated
hosts without a shared run folder (needs root: skipped otherwise)."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import string
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
from torch.distributed import TCPStore

from gradsync.bench.cluster import ClusterSpec, SimulatedCluster
from gradsync.distributed import free_port
from gradsync.run import jobwide
from gradsync.run import monitor as monitor_module
from gradsync.run.jobwide import MAX_RANK_BYTES, JobBoard, StoreAddress, compact_state, expand_state, rendezvous_store
from gradsync.run.launcher import build_parser
from gradsync.run.monitor import Monitor
from gradsync.run.options import RunOptions
from gradsync.rundir import RunDir, read_attempt, write_json
from tests.harness import REPO_ROOT


@pytest.fixture
def store():
    """A rendezvous store as node 0's agent serves it, and its address."""
    server = TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=5), wait_for_workers=False, multi_tenant=True)
    yield server, StoreAddress("127.0.0.1", server.port, "job-1")
    del server


@pytest.fixture
def connects(monkeypatch):
    """The TCP connections the job board tries, in order (it checks the store is there with one
    before every request, so these count its attempts to reach the store). RETRY_AFTER_S is put
    out of reach: "no retry yet" then holds however slowly the test runs."""
    monkeypatch.setattr(jobwide, "RETRY_AFTER_S", 3600.0)
    tried = []
    connect = socket.create_connection

    def counted(address, *args, **kwargs):
        tried.append(address)
        return connect(address, *args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", counted)
    return tried


def _record(index: int, op: str = "all_reduce", site: str = "train.py:38", state: str = "finished") -> dict:
    return {"index": index, "group": "default", "seq": index + 1, "op": op, "signature": "float32[577]", "kind": "",
            "site": site, "state": state, "entered": 100.0 + index, "finished": None, "crc": index, "error": None}


def _snapshot(rank: int, now: float, last_progress: float, pid: int | None = None, records: int = 7) -> dict:
    return {
        "rank": rank, "local_rank": 0, "world_size": 2, "local_world_size": 1, "attempt": 0, "host": f"host{rank}",
        "pid": pid or os.getpid(), "started": now - 60, "target": "train.py", "time": now, "phase": "running",
        "last_progress": last_progress, "groups": {"default": {"ranks": [0, 1], "seq": records, "crc": 1, "checkpoints": []}},
        "stack": ["train.py:49 in <module>", "train.py:38 in main"], "location": "train.py:38", "backward_passes": 5,
        "first_nonfinite": None, "nonfinite_passes": 0, "unused_parameters": [], "ddp_parameters": [["0.weight"]],
        "records": [_record(i) for i in range(records)], "collectives": records,
    }


# -- publishing and reading -----------------------------------------------------------------------


def test_a_node_reads_what_another_node_published(store):
    _, address = store
    # Republished at most once a minute: this test's publishes are milliseconds apart (>= 5x within it).
    node0, node1 = JobBoard(address, interval_s=60), JobBoard(address, interval_s=60)
    now = time.time()
    snapshot = _snapshot(0, now, now)
    snapshot["groups"]["data parallel"] = {"ranks": list(range(0, 4096, 8)), "seq": 3, "crc": 2, "checkpoints": [[2, 5]]}
    node0.publish(0, {0: snapshot}, stopped=set())
    seen = node1.read(0, world_size=2, local={1}, max_age_s=0)
    assert list(seen) == [0]
    assert seen[0]["remote"] and not seen[0]["stopped_by_gradsync"]
    assert seen[0]["records"] == snapshot["records"] and seen[0]["location"] == "train.py:38"
    assert seen[0]["groups"]["data parallel"]["ranks"] == list(range(0, 4096, 8)), "a long member list comes back whole"
    assert node1.read(1, world_size=2, local={1}, max_age_s=0) == {}, "attempts are kept apart"

    # Within the interval an ordinary change waits; a stop or an exit is published at once.
    node0.publish(0, {0: {**snapshot, "location": "train.py:40"}}, stopped=set())
    assert node1.read(0, world_size=2, local={1}, max_age_s=0)[0]["location"] == "train.py:38"
    node0.publish(0, {0: snapshot}, stopped={0})
    assert node1.read(0, world_size=2, local={1}, max_age_s=0)[0]["stopped_by_gradsync"]
    ended = {**snapshot, "exit": {"status": "exception", "time": now, "type": "ValueError", "message": "bad"}}
    node0.publish(0, {0: ended}, stopped={0})
    assert node1.read(0, world_size=2, local={1}, max_age_s=0)[0]["exit"]["type"] == "ValueError"


def test_a_store_that_goes_away_leaves_what_was_read_last(connects):
    """Once the store is gone, each board finds out with one connection attempt, answers what it
    read last, and does not try again before RETRY_AFTER_S: the monitor never waits on a dead store."""
    server = TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=5), wait_for_workers=False)
    address = StoreAddress("127.0.0.1", server.port, "job-1")
    node0, node1 = JobBoard(address, interval_s=0.1), JobBoard(address, interval_s=0.1)
    node0.publish(0, {0: _snapshot(0, time.time(), time.time())}, stopped=set())
    assert list(node1.read(0, world_size=2, local={1}, max_age_s=0)) == [0]
    read_at = time.time()
    del server  # node 0's agent ended with its job
    connects.clear()
    assert list(node1.read(0, world_size=2, local={1}, max_age_s=0)) == [0], "what was read last"
    assert len(connects) == 1 and not node1.reachable, "one attempt tells the store is gone"
    assert node1.read(0, world_size=2, local={1}, max_age_s=0, not_before=read_at + 1) == {}, "unless it is too old"
    assert len(connects) == 1, "no retry before RETRY_AFTER_S"
    node0.publish(0, {0: _snapshot(0, time.time(), time.time())}, stopped={0})
    assert len(connects) == 2 and not node0.reachable
    node0.publish(0, {0: _snapshot(0, time.time(), time.time())}, stopped={0})
    assert len(connects) == 2, "what could not be published waits for the retry"


def test_an_unreachable_store_neither_blocks_nor_raises(connects):
    """A closed port refuses at once; a server that accepts and never answers (a stopped process)
    would hold TCPStore's handshake forever: the board leaves that handshake waiting on a thread
    of its own and returns. Either way it then leaves the store alone until RETRY_AFTER_S."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    dead_port = closed.getsockname()[1]
    closed.close()
    silent = socket.socket()  # accepts connections, never answers (a stopped process)
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        for port, answers in ((dead_port, "refuses"), (silent.getsockname()[1], "never")):
            connects.clear()
            board = JobBoard(StoreAddress("127.0.0.1", port, "job-1"), interval_s=0.1)
            board.publish(0, {0: _snapshot(0, time.time(), time.time())}, stopped=set())
            assert len(connects) == 1 and not board.reachable
            if answers == "never":
                assert board._connecting is not None and board._connecting.is_alive(), "returned while the handshake still waits"
            else:
                assert board._connecting is None, "no handshake with a port that refused"
            assert board.read(0, world_size=2, local={0}, max_age_s=0) == {}
            board.read(0, world_size=2, local={0}, max_age_s=0)
            assert len(connects) == 1, "no retry before RETRY_AFTER_S"
    finally:
        silent.close()


# -- what one rank publishes ----------------------------------------------------------------------


def _words(count: int, length: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choices(string.ascii_letters, k=length)) for _ in range(count)]


def test_what_a_rank_publishes_is_bounded():
    now = time.time()
    huge = _snapshot(0, now, now, records=0)
    names = _words(20000, 40, seed=1)
    huge.update({
        "records": [{**_record(i), "signature": name * 10, "site": f"train.py:{i}"} for i, name in enumerate(names[:256])],
        "stack": [f"{name}.py:{i} in f" for i, name in enumerate(names[:1000])],
        "groups": {
            f"group {g}": {"ranks": sorted(random.Random(g).sample(range(100000), 4096)), "seq": g, "crc": g,
                           "checkpoints": [[s, s * 7919] for s in range(256)]}
            for g in range(200)
        },
        "flight": {"time": now, "entries": [{**_record(i), "backend_state": name} for i, name in enumerate(names[:2000])],
                   "groups": {f"group {g}": list(range(g, 100000, 200)) for g in range(200)}},
        "unused_parameters": names,
        "ddp_parameters": [names],
        "exit": {"status": "exception", "time": now, "type": "RuntimeError", "message": "x" * 4000,
                 "traceback": "".join(_words(3000, 40, seed=2)) + "the last line", "location": "train.py:38"},
    })
    data = compact_state(huge)
    assert len(data) <= MAX_RANK_BYTES
    state = expand_state(data)
    assert state["rank"] == 0 and state["location"] == "train.py:38" and state["exit"]["type"] == "RuntimeError"
    assert state["exit"]["traceback"].endswith("the last line"), "a traceback keeps its end"
    assert state["records"] and state["records"][-1]["index"] == 255, "the newest records are kept"
    assert state["stack"][-1] == huge["stack"][-1], "and the innermost frames"
    assert not state["flight"]["entries"] or state["flight"]["entries"][-1]["index"] == 1999

    # A state past every trim (thousands of unknown keys) still says who the rank is and how it ended.
    odd = {**_snapshot(1, now, now), **{key: key for key in _words(20000, 30, seed=3)},
           "exit": {"status": "exit_code", "code": 3, "time": now}}
    state = expand_state(compact_state(odd))
    assert len(compact_state(odd)) <= MAX_RANK_BYTES
    assert (state["rank"], state["location"], state["exit"]["code"]) == (1, "train.py:38", 3)


# -- where the store is ---------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [
    ["--standalone", "--nproc-per-node", "2"],
    ["--nproc-per-node", "2"],
    ["--nnodes", "1:1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "head:29400"],
    ["--nnodes", "2", "--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "head:2379"],
])
def test_the_board_is_off_for_one_node_and_without_a_tcp_store(argv):
    assert rendezvous_store(build_parser().parse_args([*argv, "train.py"])) is None


@pytest.mark.parametrize("argv, address", [
    (["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29600"],
     StoreAddress("10.0.0.1", 29600, "none")),
    (["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1"], StoreAddress("10.0.0.1", 29500, "none")),
    (["--nnodes", "1:4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "head:29401", "--rdzv-id", "job7"],
     StoreAddress("head", 29401, "job7")),
    (["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "head"], StoreAddress("head", 29400, "none")),
])
def test_the_board_uses_the_store_the_agents_share(argv, address):
    assert rendezvous_store(build_parser().parse_args([*argv, "train.py"])) == address


# -- the monitor with the board -------------------------------------------------------------------


@pytest.mark.launches
def test_a_stall_is_job_wide_and_only_this_nodes_ranks_are_stopped(tmp_path, store):
    """Rank 0's files are here; rank 1 is on another node, whose PID happens to name a process this
    test started. Rank 1 progressing means no stall; once it stands still too, the stall's
    diagnosis names both ranks, and the process with rank 1's PID is left alone."""
    _, address = store
    namesake = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        now = time.time()
        write_json(RunDir(tmp_path).snapshot(0, 0), _snapshot(0, now, now - 30, records=7))
        other_node = JobBoard(address, interval_s=0)
        reports = []
        clock = [now]  # the monitor judges the states at this time, however long the test takes
        monitor = Monitor(RunOptions(run_dir=tmp_path, stall_timeout_s=5), lambda d, _: reports.append(d), store=address,
                          clock=lambda: clock[0])

        other_node.publish(0, {1: _snapshot(1, now, now, pid=namesake.pid, records=6)}, stopped=set())
        monitor.poll()
        assert reports == [], "a rank on another node progresses: no stall"

        # What was read of rank 1 is then older than the read a verdict asks for (the board times
        # its reads by the real clock): a lower bound, which a slow machine only lengthens.
        time.sleep(monitor.poll_s + 0.1)
        clock[0] = now + 1
        stuck = _snapshot(1, now + 1, now - 30, pid=namesake.pid, records=6)
        stuck["records"][-1]["state"] = "entered"
        other_node.publish(0, {1: stuck}, stopped=set())
        monitor.poll()
        assert [d["trigger"] for d in reports] == ["stall"]
        assert set(reports[0]["ranks"]) == {"0", "1"}
        assert monitor.stopped_pids == set()
        assert psutil.Process(namesake.pid).status() != psutil.STATUS_ZOMBIE and namesake.poll() is None
    finally:
        namesake.kill()
        namesake.wait()


@pytest.mark.parametrize("remote_end", ["silent", "finished", "current"])
def test_only_a_silent_rank_of_another_node_is_unreachable(tmp_path, store, remote_end):
    """This node's rank 0 stalls. Rank 1, on another node, is unreachable only when its state went
    stale with no word of its end: one whose node published that it finished, or whose state is
    current (it waits in a collective like rank 0), is diagnosed from what it says."""
    _, address = store
    now = time.time()
    write_json(RunDir(tmp_path).snapshot(0, 0), _snapshot(0, now, now - 30, records=7))
    published = now - 20 if remote_end != "current" else now
    remote = _snapshot(1, published, now - 30, pid=999999, records=7)
    if remote_end == "finished":
        remote["exit"] = {"status": "finished", "code": 0, "time": now - 20}
    else:
        remote["records"][-1]["state"] = "entered"
    JobBoard(address, interval_s=0).publish(0, {1: remote}, stopped=set())
    reports = []
    monitor = Monitor(RunOptions(run_dir=tmp_path, stall_timeout_s=5), lambda d, _: reports.append(d), store=address,
                      clock=lambda: now)
    monitor.poll()
    (diagnosis,) = reports
    errors = [f["category"] for f in diagnosis["findings"] if f["severity"] == "error"]
    if remote_end == "silent":
        assert errors == ["rank_unreachable"] and diagnosis["findings"][0]["ranks"] == [1], diagnosis
    else:
        assert "rank_unreachable" not in errors and errors, diagnosis


def test_a_rank_of_another_rendezvous_round_is_not_taken_for_a_peer(tmp_path, store):
    """A node that comes back, or joins an elastic job late, numbers its attempts from 0 while
    the others are further on: ranks meet on the board by rendezvous round (the store their
    workers share), so another round's rank is never taken for a peer, whatever the attempts."""
    _, address = store
    now = time.time()
    write_json(RunDir(tmp_path).snapshot(0, 1), {**_snapshot(1, now, now), "round_store": "10.0.0.1:2002"})
    old_round = {**_snapshot(0, now - 20, now - 40), "round_store": "10.0.0.1:2001"}
    JobBoard(address, interval_s=0).publish("10.0.0.1:2001", {0: {**old_round, "exit": {"status": "exception", "time": now - 20}}}, stopped=set())
    monitor = Monitor(RunOptions(run_dir=tmp_path, stall_timeout_s=5), lambda d, _: None, store=address)
    snapshots, exits = monitor._job_wide(0, *read_attempt(RunDir(tmp_path), 0), max_age_s=0)
    assert set(snapshots) == {1} and exits == {}
    # The other node's rank of the same round, published at its attempt 3.
    peer = JobBoard(address, interval_s=0)
    peer.publish("10.0.0.1:2002", {0: {**_snapshot(0, now, now), "attempt": 3, "round_store": "10.0.0.1:2002"}}, stopped=set())
    snapshots, _ = monitor._job_wide(0, *read_attempt(RunDir(tmp_path), 0), max_age_s=0)
    assert set(snapshots) == {0, 1}, "the same round's rank is"


class _Failure:
    """What torchrun's agent returns for a failed worker (a ProcessFailure)."""

    def __init__(self, pid: int, exitcode: int):
        self.pid, self.exitcode = pid, exitcode

    def signal_name(self) -> str:
        return signal.Signals(-self.exitcode).name


def test_how_an_agent_saw_a_rank_end_reaches_the_other_node(tmp_path, store, monkeypatch):
    """Rank 1 (node 1) is killed by SIGKILL: it leaves no exit record, only its agent knows the
    signal. Both agents hand what they saw to their monitors; each publishes it and waits for the
    other's, and node 0's diagnosis then reads rank 1's end as node 1's does.

    END_WAIT_S is put out of reach, so that only hearing from the other node ends each wait: that
    both return shows neither waits longer than needed, whatever the machine's speed."""
    monkeypatch.setattr(monitor_module, "END_WAIT_S", 3600.0)
    _, address = store
    now = time.time()
    folders = [RunDir(tmp_path / "host0"), RunDir(tmp_path / "host1")]
    write_json(folders[0].snapshot(0, 0), _snapshot(0, now, now - 1, pid=1000))
    write_json(folders[0].exit_record(0, 0), {**_snapshot(0, now, now - 1, pid=1000), "exit": {
        "status": "exception", "time": now, "type": "RuntimeError", "message": "Connection reset by peer",
        "location": "train.py:38"}})
    write_json(folders[1].snapshot(0, 1), _snapshot(1, now - 0.5, now - 1, pid=1001))
    monitors = [Monitor(RunOptions(run_dir=folder.root, stall_timeout_s=5), lambda d, _: None, store=address)
                for folder in folders]
    failures = [{0: _Failure(1000, 1)}, {1: _Failure(1001, -9)}]
    hooks = [threading.Thread(target=monitor.agent_ended, args=(failed,), daemon=True) for monitor, failed in zip(monitors, failures)]
    for hook in hooks:
        hook.start()
    for hook in hooks:
        # A hang detector: each hook takes a few store requests and 0.1 s polls, about a second
        # on a loaded machine (END_WAIT_S, 3 s, is what production allows it); 60 s is >= 5x that.
        hook.join(timeout=60)
    assert not any(hook.is_alive() for hook in hooks), "a node waited for the other past its end"
    assert [monitor.silent[0] for monitor in monitors] == [set(), set()], "each heard of the other's end"
    assert monitors[0].board.all_done(0, world_size=2)
    seen = JobBoard(address, interval_s=1).read(0, world_size=2, local=set(), max_age_s=0)
    assert seen[1]["agent_exit"] == {"exitcode": -9, "signal": "SIGKILL"} and seen[0]["agent_exit"]["exitcode"] == 1
    for monitor, failed in zip(monitors, failures):
        diagnosis = monitor.final(failed)
        first = diagnosis["findings"][0]
        assert (first["category"], first["ranks"]) == ("rank_crashed", [1])
        assert diagnosis["ranks"]["1"].startswith("killed by SIGKILL")


def test_what_a_rank_said_as_it_died_reaches_the_other_node(tmp_path, store, monkeypatch):
    """Rank 0 (node 0) aborts in Gloo's size check, so soon after a restart that its last
    snapshot still shows no group: the backend's "580 vs 4" in its log is what tells the collective
    mismatch. Node 1 has no such log; the words must come with rank 0's end, so that node 1 tells
    the mismatch as node 0 does (seen on a real Slurm cluster: node 1 said rank_crashed)."""
    monkeypatch.setattr(monitor_module, "END_WAIT_S", 3600.0)
    _, address = store
    now = time.time()
    folders = [RunDir(tmp_path / "host0"), RunDir(tmp_path / "host1")]
    metric = {**_record(5, site="train.py:37", state="entered"), "signature": "float32[1] op=SUM"}
    write_json(folders[0].snapshot(0, 0), {**_snapshot(0, now, now - 1, pid=1000, records=5), "groups": {},
                                           "records": [*(_record(i) for i in range(5)), metric]})
    folders[0].log(0, 0).write_text(
        "terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
        "  what():  [enforce fail at gloo/transport/tcp/pair.cc:456] op.preamble.length <= op.nbytes. 580 vs 4. "
        "Received data size doesn't match expected size. Is there a distributed collective mismatch in your code?\n")
    failed = {**_record(5, state="failed"), "signature": "float32[577]"}
    rank1 = {**_snapshot(1, now, now - 1, pid=1001, records=5), "records": [*(_record(i) for i in range(5)), failed]}
    write_json(folders[1].snapshot(0, 1), rank1)
    write_json(folders[1].exit_record(0, 1), {**rank1, "exit": {
        "status": "exception", "time": now, "type": "RuntimeError", "message": "Connection reset by peer",
        "location": "train.py:33"}})
    monitors = [Monitor(RunOptions(run_dir=folder.root, stall_timeout_s=5), lambda d, _: None, store=address)
                for folder in folders]
    failures = [{0: _Failure(1000, -6)}, {1: _Failure(1001, 1)}]
    hooks = [threading.Thread(target=monitor.agent_ended, args=(failed,), daemon=True) for monitor, failed in zip(monitors, failures)]
    for hook in hooks:
        hook.start()
    for hook in hooks:
        hook.join(timeout=60)  # a hang detector, as in the test above
    assert not any(hook.is_alive() for hook in hooks), "a node waited for the other past its end"
    diagnoses = [monitor.final(failed) for monitor, failed in zip(monitors, failures)]
    for host, diagnosis in enumerate(diagnoses):
        first = diagnosis["findings"][0]
        assert (first["category"], first["ranks"]) == ("collective_mismatch", [0]), f"host {host}: {first}"
        assert "580 vs 4" in diagnosis["ranks"]["0"], f"host {host}: {diagnosis['ranks']['0']}"


# -- two hosts, no shared folder -----------------------------------------------------------------

ZOO = REPO_ROOT / "tests/run/zoo"
# A hang detector for `gradsync run` on two simulated hosts: each test's two launchers took 40-58 s
# on 2 cores shared with other test runs (load average 10-16); what it catches is a stall that no
# launcher stopped, left to Gloo's 30-minute timeout. 300 s is >= 5x the slowest.
TWO_HOSTS_HANG_S = 300


def _line(script: str, marker: str) -> str:
    text = (ZOO / script).read_text()
    number = next(i for i, line in enumerate(text.splitlines(), 1) if line.rstrip().endswith(f"# zoo: {marker}"))
    return f"tests/run/zoo/{script}:{number}"


def _on_two_hosts(tmp_path: Path, script: str) -> tuple[list[int], str, list[dict]]:
    """`gradsync run` of a zoo script on two simulated hosts, one rank each, each with its own run
    folder: the launchers' exit codes, their output and each host's diagnosis."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with SimulatedCluster(ClusterSpec(hosts=2)) as cluster:
        launchers = []
        for host in range(2):
            argv = [sys.executable, "-m", "gradsync", "run", *cluster.torchrun_args(host, nproc_per_node=1, master_port=port),
                    "--stall-timeout", "5", "--run-dir", str(tmp_path / f"host{host}"), f"tests/run/zoo/{script}"]
            with open(tmp_path / f"host{host}.log", "w") as log:
                launchers.append(cluster.run(host, argv, env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + TWO_HOSTS_HANG_S
        codes = [launcher.wait(timeout=max(1.0, deadline - time.monotonic())) for launcher in launchers]
    logs = "".join(path.read_text() for path in sorted(tmp_path.glob("host*.log")))
    assert not list(Path(tmp_path / "host0").glob("workers/attempt0/rank1*")), "no shared folder: each host has its own rank"
    diagnoses = [json.loads((tmp_path / f"host{host}" / "diagnosis.json").read_text()) for host in range(2)]
    return codes, logs, diagnoses


@pytest.mark.launches
@pytest.mark.timeout(TWO_HOSTS_HANG_S + 60)
def test_two_hosts_each_name_the_other_hosts_rank(needs_cluster, tmp_path):
    """A barrier only rank 0 calls: each host's launcher sees one rank, yet both diagnose the
    collective mismatch with both ranks' lines, as one host running both ranks does."""
    codes, logs, diagnoses = _on_two_hosts(tmp_path, "barrier_inside_rank0.py")
    assert codes == [1, 1], logs
    expected = {"0": _line("barrier_inside_rank0.py", "barrier"), "1": _line("barrier_inside_rank0.py", "backward")}
    for diagnosis in diagnoses:
        first = diagnosis["findings"][0]
        assert (diagnosis["trigger"], first["category"]) == ("stall", "collective_mismatch"), logs
        assert first["locations"] == expected
        assert set(diagnosis["ranks"]) == {"0", "1"}
        assert expected["0"] in diagnosis["ranks"]["0"] and expected["1"] in diagnosis["ranks"]["1"]
    assert "Traceback" not in logs and "c10d] recv" not in logs


@pytest.mark.launches
@pytest.mark.timeout(TWO_HOSTS_HANG_S + 60)
def test_two_hosts_both_name_the_rank_killed_on_one_of_them(needs_cluster, tmp_path):
    """Rank 1, alone on host 1, is killed by SIGKILL: it leaves no exit record, and only host 1's
    agent sees its exit code. That agent publishes it at once, before node 0's store goes, so host
    0 diagnoses the crash as host 1 does (and as one host running both ranks does), not a hang."""
    codes, logs, diagnoses = _on_two_hosts(tmp_path, "killed_worker.py")
    assert codes == [1, 1], logs
    killed_at = _line("killed_worker.py", "backward")  # the last collective rank 1 entered
    for host, diagnosis in enumerate(diagnoses):
        first = diagnosis["findings"][0]
        assert (diagnosis["status"], diagnosis["trigger"], first["category"], first["ranks"]) == (
            "failed", "failure", "rank_crashed", [1]), f"host {host}: {logs}"
        assert "killed by SIGKILL (exit code -9)" in first["message"]
        assert first["locations"] == {"1": killed_at}
        assert diagnosis["ranks"]["1"] == f"killed by SIGKILL; last seen at {killed_at}"
        assert "failed as a consequence" in diagnosis["ranks"]["0"]
    assert "Traceback" not in logs and "could not tell the other nodes" not in logs
