"""Flight Recorder as a record: dumps in NCCL's and Gloo's shape, joined to the recorder's lines,
and the verdicts they change; then a real Gloo job whose dumps torch's own analyser reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from gradsync.run import flight
from gradsync.run.analysis.rules import diagnose
from gradsync.run.analysis.views import RankView

PY = sys.executable
NS = 1_000_000_000


def fr_entry(seq, op="all_reduce", *, state="completed", retired=False, pg=("0", "default_pg"), created_s=10.0,
             sizes=((8,),), dtype="Float", p2p=False):
    """One entry as torch's dump holds it (NCCL's states: scheduled, started, completed)."""
    return {
        "pg_id": int(pg[0]), "process_group": list(pg), "collective_seq_id": 0 if p2p else seq, "p2p_seq_id": seq if p2p else 0,
        "is_p2p": p2p, "profiling_name": f"nccl:{op}", "input_sizes": [list(s) for s in sizes],
        "input_dtypes": [dtype] * len(sizes), "state": state, "retired": retired, "time_created_ns": int(created_s * NS),
    }


def dump_of(entries, groups=None, *, time=50.0, status=None):
    return flight.compact(entries, status or {}, groups or {"default": [0, 1]}, time)


def ring(seq, op="all_reduce", *, site="train.py:10", state="finished", entered=0.0, finished=None, kind="", group="default",
         signature="float32[8] op=SUM"):
    return {"index": seq, "group": group, "seq": seq, "op": op, "signature": signature, "kind": kind, "site": site,
            "state": state, "entered": entered, "finished": finished, "crc": None, "error": None}


def view(rank, records, dump=None, *, location="train.py:30", last_progress=40.0, alive=True, groups=None):
    snapshot = {"rank": rank, "records": records, "location": location, "collectives": len(records), "time": 60.0,
                "last_progress": last_progress, "backward_passes": 3,
                "groups": groups or {"default": {"ranks": [0, 1], "seq": len(records), "crc": 0, "checkpoints": []}}}
    if dump is not None:
        snapshot["flight"] = dump
    return RankView(rank, snapshot=snapshot, alive=alive)


# -- what a dump says ---------------------------------------------------------------------------


def test_completion_follows_the_backend_state_not_the_python_call():
    entries = [
        fr_entry(1, state="completed"),
        fr_entry(2, state="scheduled", retired=True),  # dropped after finishing
        fr_entry(3, state="started"),  # on the GPU, not done
        fr_entry(4, state="scheduled"),  # enqueued behind it
    ]
    compact = dump_of(entries)
    assert [e["state"] for e in compact["entries"]] == ["finished", "finished", "entered", "entered"]
    assert [e["backend_state"] for e in compact["entries"]] == ["completed", "scheduled", "started", "scheduled"]
    assert compact["entries"][0]["op"] == "all_reduce" and compact["entries"][0]["signature"] == "Float[8]"


def test_gloo_completion_comes_from_the_groups_status():
    # Gloo leaves every entry "scheduled"; its pg_status counts the last completed collective.
    entries = [fr_entry(seq, state="scheduled") for seq in (1, 2, 3)]
    compact = dump_of(entries, status={"0": {"last_completed_collective": 2, "last_enqueued_collective": 3}})
    assert [e["state"] for e in compact["entries"]] == ["finished", "finished", "entered"]


def test_groups_and_point_to_point():
    first, second = dump_of([fr_entry(1, pg=("3", "mesh_tp")), fr_entry(1, "send", p2p=True)])["entries"]
    assert first["group"] == "group 3" and first["seq"] == 1
    assert second["seq"] is None and second["op"] == "send"


def test_entries_take_the_line_and_kind_of_the_recorded_call_that_spans_them():
    backward = ring(7, kind="DDP gradients of a backward pass", site="train.py:20", entered=10.0, finished=10.5)
    user = ring(8, site="train.py:24", entered=11.0, finished=11.1)
    entries = dump_of([
        fr_entry(20, created_s=10.1), fr_entry(21, created_s=10.4),  # two buckets of the backward pass
        fr_entry(22, created_s=11.05),
        fr_entry(3, pg=("2", "undefined"), created_s=10.2),  # another group: a DTensor's, say
    ])["entries"]
    joined = flight.join_sites(entries, [backward, user])
    assert [(e["seq"], e["site"], e["kind"]) for e in joined] == [  # oldest first
        (20, "train.py:20", "DDP gradients of a backward pass"), (3, None, ""),
        (21, "train.py:20", "DDP gradients of a backward pass"), (22, "train.py:24", ""),
    ]


# -- verdicts it changes --------------------------------------------------------------------------


def test_on_nccl_a_rank_whose_python_moved_on_still_waits_in_an_unfinished_collective():
    # NCCL: rank 0's all_reduce #5 returned in Python (the ring says finished) and rank 0 now
    # blocks in loss.item(); the backend never completed it because rank 1 sits in a data read.
    rank0 = view(0, [ring(4, entered=1.0, finished=1.1), ring(5, site="train.py:12", entered=2.0, finished=2.0)],
                 dump_of([fr_entry(4, created_s=1.05), fr_entry(5, state="scheduled", created_s=2.0)]), location="train.py:13")
    rank1 = view(1, [ring(4, entered=1.0, finished=1.1)], dump_of([fr_entry(4, created_s=1.05)]), location="data.py:7")
    (finding,) = diagnose({0: rank0, 1: rank1}, trigger="stall", now=60.0)["findings"]
    assert finding["category"] == "rank_stuck" and finding["ranks"] == [1]
    assert "rank 0 waits in all_reduce #5" in finding["message"] and "train.py:12" in finding["message"]
    assert finding["locations"]["1"] == "data.py:7"


def test_without_a_dump_the_same_ranks_show_no_wait():
    rank0 = view(0, [ring(5, site="train.py:12", entered=2.0, finished=2.0)], location="train.py:13")
    rank1 = view(1, [ring(4, entered=1.0, finished=1.1)], location="data.py:7")
    findings = diagnose({0: rank0, 1: rank1}, trigger="stall", now=60.0)["findings"]
    assert not any(f["category"] == "rank_stuck" for f in findings)


def test_a_dump_older_than_the_ranks_last_progress_does_not_say_where_it_waits():
    rank0 = view(0, [], dump_of([fr_entry(5, state="scheduled")], time=30.0), last_progress=40.0)
    assert rank0.waiting_on() is None
    assert view(0, [], dump_of([fr_entry(5, state="scheduled")], time=45.0), last_progress=40.0).waiting_on()["seq"] == 5


def test_every_rank_in_the_same_unfinished_collective_is_a_hang():
    views = {
        r: view(r, [ring(9, entered=5.0, finished=5.0)], dump_of([fr_entry(9, state="started", created_s=5.0)]))
        for r in (0, 1)
    }
    (finding,) = diagnose(views, trigger="stall", now=60.0)["findings"]
    assert finding["category"] == "hang" and finding["ranks"] == [0, 1]


def test_ranks_in_unrecorded_collectives_of_different_groups_are_named_with_their_lines():
    # Rank 0 waits in a tensor-parallel all_gather (group 2) its peer never reaches; rank 1 waits
    # in the default group's barrier rank 0 never reaches. Neither call went through the recorder.
    groups = {"default": [0, 1], "group 2": [0, 1]}
    tp = ("2", "mesh_tp")
    rank0 = view(0, [], dump_of([fr_entry(8, "barrier", created_s=1.0), fr_entry(3, "all_gather", pg=tp, created_s=1.0),
                                 fr_entry(4, "all_gather", pg=tp, state="scheduled", created_s=2.0)], groups), location="model.py:40")
    rank1 = view(1, [], dump_of([fr_entry(8, "barrier", created_s=1.0), fr_entry(3, "all_gather", pg=tp, created_s=1.0),
                                 fr_entry(9, "barrier", state="scheduled", created_s=2.0)], groups), location="train.py:50")
    (finding,) = diagnose({0: rank0, 1: rank1}, trigger="stall", now=60.0)["findings"]
    assert finding["category"] == "collective_mismatch" and finding["ranks"] == [0, 1]
    assert finding["locations"] == {"0": "model.py:40", "1": "train.py:50"}
    assert "all_gather #4 on group 2" in finding["message"] and "barrier #9" in finding["message"]


def test_different_ops_at_one_backend_sequence_number_are_a_mismatch_with_both_lines():
    # Each rank blocks in its newest entry, at the line its own stack shows.
    rank0 = view(0, [], dump_of([fr_entry(7, "all_gather", state="scheduled")]), location="save.py:33")
    rank1 = view(1, [], dump_of([fr_entry(7, "barrier", state="scheduled", sizes=())]), location="train.py:38")
    (finding,) = diagnose({0: rank0, 1: rank1}, trigger="stall", now=60.0)["findings"]
    assert finding["category"] == "collective_mismatch"
    assert finding["locations"] == {"0": "save.py:33", "1": "train.py:38"}
    assert "Flight Recorder" in finding["message"]


def test_per_rank_splits_of_an_all_to_all_are_not_a_mismatch():
    views = {r: view(r, [], dump_of([fr_entry(3, "all_to_all", state="scheduled", sizes=((4 + r, 8),))])) for r in (0, 1)}
    (finding,) = diagnose(views, trigger="stall", now=60.0)["findings"]
    assert finding["category"] == "hang"


# -- turning it on ----------------------------------------------------------------------------------


def test_enable_sets_the_buffer_unless_the_user_did(monkeypatch):
    monkeypatch.delenv(flight.BUFFER_VARIABLE, raising=False)
    monkeypatch.delenv(flight.NCCL_BUFFER_VARIABLE, raising=False)
    assert flight.enable(2000) and os.environ[flight.BUFFER_VARIABLE] == "2000"
    monkeypatch.setenv(flight.BUFFER_VARIABLE, "0")  # the user turned it off
    assert not flight.enable(2000)
    monkeypatch.delenv(flight.BUFFER_VARIABLE)
    assert not flight.enable(0) and flight.BUFFER_VARIABLE not in os.environ


# -- a real job -------------------------------------------------------------------------------------

ALONE_IN_A_FUNCTIONAL_ALL_REDUCE = """
    import time
    import torch
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as funcol

    dist.init_process_group("gloo")
    t = torch.ones(4)
    dist.all_reduce(t)
    if dist.get_rank() == 0:
        funcol.all_reduce(t, "sum", dist.group.WORLD).wait()      # line 11: rank 0 alone
    else:
        time.sleep(300)                                           # line 13
"""


@pytest.mark.launches
def test_a_hung_gloo_job_leaves_dumps_that_gradsync_and_torchs_analyser_both_read(tmp_path):
    (tmp_path / "train.py").write_text(textwrap.dedent(ALONE_IN_A_FUNCTIONAL_ALL_REDUCE))
    done = subprocess.run(
        [PY, "-m", "gradsync", "run", "--standalone", "--nproc-per-node", "2", "--stall-timeout", "4", "--run-dir", "run", "train.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 1, done.stderr
    diagnosis = json.loads((tmp_path / "run" / "diagnosis.json").read_text())
    finding = diagnosis["findings"][0]
    assert finding["category"] == "rank_stuck" and finding["ranks"] == [1], finding
    assert "rank 0 waits in all_reduce #2" in finding["message"] and "train.py:11" in finding["message"], finding
    assert finding["locations"]["1"] == "train.py:13"
    raw = tmp_path / "run" / "workers" / "attempt0" / "flight"
    assert sorted(p.name for p in raw.iterdir()) == ["rank_0", "rank_1"]
    analyser = subprocess.run([PY, "-m", "torch.distributed.flight_recorder.fr_trace", str(raw), "-p", "rank_"],
                              capture_output=True, text=True, timeout=120)
    assert analyser.returncode == 0, analyser.stderr
    assert "missing ranks: {1}" in analyser.stdout + analyser.stderr, analyser.stderr


@pytest.mark.launches
def test_turned_off_it_leaves_no_dump(tmp_path):
    (tmp_path / "train.py").write_text("import torch.distributed as dist, torch\ndist.init_process_group('gloo')\n"
                                       "dist.all_reduce(torch.ones(1))\ndist.destroy_process_group()\n")
    done = subprocess.run(
        [PY, "-m", "gradsync", "run", "--standalone", "--nproc-per-node", "1", "--flight-recorder", "0",
         "--run-dir", "run", "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    attempt = tmp_path / "run" / "workers" / "attempt0"
    assert not list(attempt.glob("flight*")) and (attempt / "rank0.exit.json").exists()


@pytest.mark.launches
def test_a_rank_that_destroyed_its_group_before_exiting_leaves_a_dump_torchs_analyser_reads(tmp_path):
    (tmp_path / "train.py").write_text("import time, torch, torch.distributed as dist\ndist.init_process_group('gloo')\n"
                                       "dist.all_reduce(torch.ones(1))\ntime.sleep(1.5)\ndist.destroy_process_group()\n")
    done = subprocess.run(
        [PY, "-m", "gradsync", "run", "--standalone", "--nproc-per-node", "2", "--run-dir", "run", "train.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    raw = tmp_path / "run" / "workers" / "attempt0" / "flight"
    analyser = subprocess.run([PY, "-m", "torch.distributed.flight_recorder.fr_trace", str(raw), "-p", "rank_"],
                              capture_output=True, text=True, timeout=120)
    assert analyser.returncode == 0, analyser.stderr
