"""Reading a rank from outside (gradsync.run.outside): py-spy's dump of a real process that holds
the GIL in a native call, its parsing, the reasons a read fails, and the verdict that uses it."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from gradsync.run import outside
from gradsync.run.analysis.rules import diagnose
from gradsync.run.outside import OutsideRead, parse_dump, read_from_outside
from tests.run.test_analysis import record, view

HOLDS_THE_GIL = """\
import ctypes, sys
def read_shard():
    ctypes.PyDLL(None).sleep(30)   # line 3: a C call that keeps the GIL
print("ready", flush=True)
read_shard()
"""


@pytest.mark.launches
def test_a_process_whose_main_thread_holds_the_gil_is_read_at_its_line(tmp_path):
    (tmp_path / "hold.py").write_text(HOLDS_THE_GIL)
    held = subprocess.Popen([sys.executable, "hold.py"], cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    try:
        assert held.stdout.readline().strip() == "ready"
        time.sleep(0.5)  # into the C call
        read = read_from_outside(held.pid, str(tmp_path))
    finally:
        held.kill()
        held.wait()
    assert isinstance(read, OutsideRead), read
    assert (read.location, read.gil, read.running) == ("hold.py:3", "the main thread", False)
    assert read.stack[-2:] == ["hold.py:5 in <module>", "hold.py:3 in read_shard"]


def test_a_dump_names_the_thread_that_holds_the_gil_and_the_users_innermost_line():
    frames = [{"name": "wait", "filename": threading.__file__, "line": 331},
              {"name": "load", "filename": "/work/train.py", "line": 12},
              {"name": "<module>", "filename": "/work/train.py", "line": 40}]
    dump = [{"os_thread_id": 99, "thread_name": "prefetch", "owns_gil": True, "active": True, "frames": []},
            {"os_thread_id": 7, "thread_name": None, "owns_gil": False, "active": False, "frames": frames}]
    read = parse_dump(dump, 7, "/work", 5.0)
    assert (read.location, read.gil, read.running, read.at) == ("train.py:12", "thread prefetch", False, 5.0)
    assert read.stack[:2] == ["train.py:40 in <module>", "train.py:12 in load"] and read.stack[2].endswith("threading.py:331 in wait")
    assert parse_dump([], 7, None, 5.0) == "py-spy read no thread"


def test_without_py_spy_a_read_says_so(monkeypatch):
    monkeypatch.setattr(outside, "py_spy", lambda: None)
    assert read_from_outside(1) == "py-spy is not installed (pip install py-spy)"


@pytest.mark.launches
def test_a_read_that_ptrace_refuses_says_why(monkeypatch, tmp_path):
    """A py-spy that answers as one refused by Yama's scope 2 does (this machine's root is not refused)."""
    refusing = tmp_path / "py-spy"
    refusing.write_text("#!/bin/sh\necho 'Error: Permission Denied: Try running again with elevated permissions' >&2\nexit 1\n")
    refusing.chmod(0o755)
    monkeypatch.setattr(outside, "py_spy", lambda: str(refusing))
    assert read_from_outside(1) == "py-spy could not read it: Error: Permission Denied: Try running again with elevated permissions"


def _silent(read: dict | None = None, failed: str | None = None):
    """Rank 1, whose own reports stopped, outside any collective; rank 0 waits for it."""
    waiting = view(0, [record(1), record(2, state="entered", site="train.py:9")], alive=True)
    silent = view(1, [record(1)], alive=True, location="train.py:4")
    silent.snapshot.update({"silent_s": 12.0, **({"outside_read": read} if read else {}),
                            **({"outside_read_failed": failed} if failed else {})})
    return {0: waiting, 1: silent}


def test_the_verdict_says_a_position_was_read_from_outside_and_how_old_the_last_report_was():
    read = OutsideRead(100.0, ["train.py:11 in main", "train.py:4 in read_shard"], "train.py:4", False, "the main thread")
    (finding,) = diagnose(_silent(read.as_dict()), trigger="stall", now=120.0)["findings"]
    assert finding["category"] == "rank_stuck" and finding["locations"]["1"] == "train.py:4"
    assert "read from outside by py-spy, its own reports stopped 12 s before: its main thread held the GIL" in finding["message"]
    (finding,) = diagnose(_silent(failed="py-spy could not read it: Permission Denied"), trigger="stall", now=120.0)["findings"]
    assert "its last report, 12 s old: py-spy could not read it: Permission Denied" in finding["message"]
    assert json.dumps(read.as_dict())  # kept in the evidence as it is


HANGS_HOLDING_THE_GIL = """\
import ctypes, time
import torch, torch.distributed as dist
def read_shard(index):
    return ctypes.PyDLL(None).sleep(60)       # line 4: a C call that keeps the GIL
def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for step in range(6):
        dist.all_reduce(torch.ones(4))        # line 9
        if rank == 1 and step == 2:
            read_shard(step)                  # line 11
        time.sleep(0.3)
    dist.destroy_process_group()
main()
"""


@pytest.mark.launches
def test_a_rank_holding_the_gil_in_a_native_call_is_named_at_that_call(tmp_path):
    """Its own reports stop with the GIL: the last one (the all_reduce before) would stand without the read."""
    (tmp_path / "train.py").write_text(HANGS_HOLDING_THE_GIL)
    done = subprocess.run([sys.executable, "-m", "gradsync", "run", "--standalone", "--nproc-per-node", "2",
                           "--stall-timeout", "5", "--run-dir", "run", "train.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert done.returncode == 1, done.stderr
    finding = json.loads((tmp_path / "run" / "diagnosis.json").read_text())["findings"][0]
    assert finding["category"] == "rank_stuck" and finding["ranks"] == [1], finding
    assert finding["locations"]["1"] == "train.py:4", finding
    assert "read from outside by py-spy" in finding["message"] and "held the GIL" in finding["message"]


LOADER = """\
import multiprocessing, time
def open_shard():
    time.sleep(30)   # line 3: a worker that never answers
if __name__ == "__main__":
    worker = multiprocessing.get_context("fork").Process(target=open_shard)
    worker.start()
    print("ready", flush=True)
    worker.join()
"""


@pytest.mark.launches
def test_a_ranks_worker_processes_are_read_at_their_lines(tmp_path):
    (tmp_path / "loader.py").write_text(LOADER)
    parent = subprocess.Popen([sys.executable, "loader.py"], cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "ready"
        time.sleep(0.5)  # into the worker's sleep
        (child,) = outside.read_children(parent.pid, str(tmp_path))
    finally:
        for process in __import__("psutil").Process(parent.pid).children():
            process.kill()
        parent.kill()
        parent.wait()
    assert child["location"] == "loader.py:3" and child["running"] is False, child


def test_a_stall_outside_collectives_names_where_the_waiting_ranks_workers_are():
    stack = ["train.py:60 in main", ".venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py:1296 in _get_data"]
    views = {rank: view(rank, [record(1)], alive=True, location="train.py:60") for rank in (0, 1)}
    for v in views.values():
        v.snapshot["stack"] = stack
    views[0].snapshot["children"] = [{"pid": 812, "location": "data.py:40", "running": False},
                                     {"pid": 813, "failed": "py-spy could not read it: Permission Denied"}]
    (finding,) = [f for f in diagnose(views, trigger="stall", now=700.0)["findings"] if f["severity"] == "error"]
    assert finding["category"] == "stalled_outside_collectives", finding
    assert ("rank 0 at train.py:60, waiting on its DataLoader's worker processes (its child processes, read from outside: pid 812 "
            "at data.py:40, not running; pid 813 could not be read (py-spy could not read it: Permission Denied))") in finding["message"]
    assert finding["details"]["children"] == {"0": views[0].snapshot["children"]}
