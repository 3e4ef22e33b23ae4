"""A rank's last words (gradsync.run.analysis.last_words) and what they change in the diagnosis.

The texts here are what Gloo and torch print (the end-to-end cases in test_zoo.py read them from
real aborts); the rules are judged on hand-made rank states, as in test_analysis.py.
"""

import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from gradsync.run.analysis.last_words import classify, read_fatal_stack, read_last_words
from gradsync.run.analysis.rules import diagnose
from gradsync.run.analysis.views import last_position
from tests.run.test_analysis import exception, record, view

GLOO_MISMATCH = (
    "terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
    "  what():  [enforce fail at /__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:456] "
    "op.preamble.length <= op.nbytes. 96 vs 64. Received data size doesn't match expected size. "
    "Is there a distributed collective mismatch in your code?\n"
)
PEER_LOST = (
    "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
    "[127.0.0.1]:40837: Connection reset by peer. This is typically caused by a remote worker hanging\n"
)
CPU_ALLOCATION = (
    "RuntimeError: [enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
    "you tried to allocate 2147483648 bytes. Error code 12 (Cannot allocate memory)\n"
)


def test_each_family_is_known_by_what_its_messages_mean():
    words = classify("rank 0 step 3\n" + GLOO_MISMATCH)
    assert words.family == "collective_mismatch" and words.cause
    assert (words.details["received_bytes"], words.details["expected_bytes"]) == (96, 64)
    assert words.details["uncaught"] == "gloo::EnforceNotMet"
    # torch's own check under TORCH_DISTRIBUTED_DEBUG=DETAIL, and NCCL's
    assert classify("RuntimeError: Detected mismatch between collectives on ranks. Rank 0 is running ...").family == "collective_mismatch"
    assert classify("init.cc:1247 NCCL WARN Mismatched collective detected, please check").family == "collective_mismatch"
    assert classify(CPU_ALLOCATION).family == "out_of_memory"
    assert classify("terminate called after throwing an instance of 'std::bad_alloc'\n  what():  std::bad_alloc").family == "out_of_memory"
    assert classify("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB").family == "out_of_memory"
    assert classify("NCCL error in: ProcessGroupNCCL.cpp:1970, invalid usage, ncclInvalidUsage").family == "nccl_error"
    assert classify(PEER_LOST).family == "peer_lost" and not classify(PEER_LOST).cause
    assert classify("[E ProcessGroupGloo.cpp:143] Gloo connectFullMesh failed: Timed out waiting").family == "backend_timeout"
    uncaught = classify("terminate called after throwing an instance of 'c10::Error'\n  what():  bad index")
    assert uncaught.family == "native_abort" and uncaught.quote().endswith("bad index")


def test_a_cause_outranks_the_consequences_printed_with_it_and_the_users_words_name_no_backend():
    assert classify(PEER_LOST + GLOO_MISMATCH).family == "collective_mismatch"
    # A script's own "timed out" or "broken pipe" is not the transport speaking.
    assert classify("reading shard 3 timed out\nBroken pipe writing the report").family is None


def test_only_the_end_of_the_log_is_read(tmp_path):
    log = tmp_path / "rank0.log"
    log.write_text(GLOO_MISMATCH + "step\n" * 10000)
    words = read_last_words(log)
    assert words.family is None and len(words.lines) == 20
    assert read_last_words(tmp_path / "missing.log") is None


def _killed(rank, records, signal, words):
    killed = view(rank, records, exitcode={"SIGABRT": -6, "SIGKILL": -9, "SIGSEGV": -11}[signal], signal=signal)
    killed.last_words = classify(words) if words is not None else None
    return killed


def test_an_abort_that_says_collective_mismatch_pairs_its_collective_with_the_peers():
    # Rank 1's hook all_reduce (#3), issued inside the backward pass (#2), met rank 0's gradients.
    ddp = dict(op="all_reduce", signature="float32[22026]", kind="DDP gradients of a backward pass", site="train.py:54")
    views = {
        0: view(0, [record(1), record(2, state="failed", **ddp)], exit=exception(PEER_LOST, location="train.py:54"), exitcode=1),
        1: _killed(1, [record(1), record(2, state="entered", **ddp),
                       record(3, signature="float32[16, 128] op=SUM", site="train.py:29", state="entered")], "SIGABRT", GLOO_MISMATCH),
    }
    views[0].last_words = classify(PEER_LOST)
    (finding,) = diagnose(views, trigger="failure", now=20.0)["findings"]
    assert finding["category"] == "collective_mismatch" and finding["ranks"] == [1]
    assert finding["locations"] == {"0": "train.py:54", "1": "train.py:29"}
    assert "96 bytes where it had posted room for 64" in finding["message"]
    assert "dmesg" not in finding["suggestion"]


def test_all_to_all_splits_that_disagree_name_the_pair():
    a2a = dict(op="all_to_all_single", signature="float32", site="moe.py:49")
    views = {
        0: _killed(0, [record(1, state="entered", **a2a)], "SIGABRT", GLOO_MISMATCH),
        1: view(1, [record(1, **a2a), record(2, op="barrier", signature="", site="moe.py:65", state="failed")],
                exit=exception(PEER_LOST, location="moe.py:65"), exitcode=1),
    }
    views[0].records[0]["args"] = {"unit": "rows", "in": [2, 2], "out": [2, 2]}
    views[1].records[0]["args"] = {"unit": "rows", "in": [3, 2], "out": [2, 2]}
    (finding,) = diagnose(views, trigger="failure", now=20.0)["findings"]
    assert finding["category"] == "shape_mismatch" and finding["ranks"] == [0, 1]
    assert "rank 1 sends 3 rows to rank 0, which expects 2" in finding["message"]


def test_without_words_that_explain_it_only_sigkill_points_at_the_oom_killer():
    for signal, oom in (("SIGKILL", True), ("SIGABRT", False), ("SIGSEGV", False)):
        views = {0: _killed(0, [record(1)], signal, None), 1: view(1, [record(1)], alive=True)}
        (finding,) = diagnose(views, trigger="failure", now=20.0)["findings"]
        assert finding["category"] == "rank_crashed"
        assert ("OOM killer" in finding["message"] + finding["suggestion"]) is oom, signal
    uncaught = "terminate called after throwing an instance of 'c10::Error'\n  what():  index out of range"
    views = {0: _killed(0, [record(1)], "SIGABRT", uncaught), 1: view(1, [record(1)], alive=True)}
    (finding,) = diagnose(views, trigger="failure", now=20.0)["findings"]
    assert "index out of range" in finding["message"] and "OOM" not in finding["message"] + finding["suggestion"]


def test_an_allocation_failure_is_a_memory_verdict_whatever_ended_the_rank():
    raised = view(1, [record(1)], exit=exception(CPU_ALLOCATION.split(": ", 1)[1], location="train.py:29", time=10.0), exitcode=1)
    raised.last_words = classify(CPU_ALLOCATION)
    lost = view(0, [record(1), record(2, state="failed")], exit=exception(PEER_LOST, time=11.0), exitcode=1)
    (finding,) = diagnose({0: lost, 1: raised}, trigger="failure", now=20.0)["findings"]
    assert finding["category"] == "out_of_memory" and finding["ranks"] == [1]
    assert finding["locations"] == {"1": "train.py:29"}
    aborted = _killed(1, [record(1)], "SIGABRT", "terminate called after throwing an instance of 'std::bad_alloc'\n  what():  std::bad_alloc")
    (finding,) = diagnose({0: view(0, [record(1)], alive=True), 1: aborted}, trigger="failure", now=20.0)["findings"]
    assert finding["category"] == "out_of_memory" and finding["ranks"] == [1]


def test_a_rank_the_backend_took_down_for_a_lost_peer_is_not_the_cause():
    lost = _killed(0, [record(1), record(2, state="entered")], "SIGABRT",
                   "terminate called after throwing an instance of 'gloo::IoException'\n  what():  " + PEER_LOST)
    first = view(1, [record(1)], exit=exception("corrupt sample", "ValueError", "data.py:7", time=10.0), exitcode=1)
    (finding,) = diagnose({0: lost, 1: first}, trigger="failure", now=20.0)["findings"]
    assert finding["category"] == "rank_crashed" and finding["ranks"] == [1]


# A native crash in a helper the training loop calls (a C call through ctypes reading address 0),
# on rank 1 at its third step; rank 0 goes on to its next all_reduce and waits there.
NATIVE_CRASH = """\
import ctypes, time
import torch, torch.distributed as dist
def decode(record):
    return ctypes.string_at(0)                  # line 4: the native call that crashes
def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for step in range(5):
        dist.all_reduce(torch.ones(4))          # line 9
        if rank == 1 and step == 2:
            decode(b"record")                   # line 11
        time.sleep(0.2)
    dist.destroy_process_group()
main()
"""


@pytest.mark.launches
def test_faulthandlers_dump_is_read_for_the_user_frames_of_the_crashed_thread(tmp_path):
    (tmp_path / "crash.py").write_text(NATIVE_CRASH.replace("main()\n", "").replace("import ctypes, time", "import ctypes, time, faulthandler"))
    dump = tmp_path / "fatal.txt"
    code = f"import faulthandler, sys; sys.path.insert(0, {str(tmp_path)!r}); handle = open({str(dump)!r}, 'w'); " \
           "faulthandler.enable(handle, all_threads=True); import crash; crash.decode(b'x')"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == -11 and "Fatal Python error" not in done.stderr  # into the file, not stderr
    assert read_fatal_stack(dump, str(tmp_path)) == ["crash.py:4"]  # ctypes' own frame is not the user's
    assert read_fatal_stack(tmp_path / "missing.txt") is None
    (tmp_path / "empty.txt").write_text("")  # the rank ended otherwise: faulthandler wrote nothing
    assert read_fatal_stack(tmp_path / "empty.txt") is None


def test_a_signal_on_a_thread_that_runs_no_python_reads_the_main_threads_stack(tmp_path):
    # Gloo aborting on its own thread ("terminate called ..."): faulthandler names no current
    # thread, only "Thread 0x..." blocks; the main thread is the one threading did not start.
    dump = tmp_path / "fatal.txt"
    dump.write_text(
        "Fatal Python error: Aborted\n\n"
        "Thread 0x00007f2dac8d56c0 (most recent call first):\n"
        f'  File "{tmp_path}/train.py", line 30 in poll\n'
        f'  File "{threading.__file__}", line 1045 in _bootstrap_inner\n'
        f'  File "{threading.__file__}", line 1002 in _bootstrap\n\n'
        "Thread 0x00007f2dcf5f8b80 (most recent call first):\n"
        f'  File "{os.path.dirname(torch.__file__)}/distributed/distributed_c10d.py", line 3252 in all_reduce\n'
        f'  File "{tmp_path}/train.py", line 10 in evaluate\n'
        f'  File "{tmp_path}/train.py", line 27 in main\n'
        '  File "<frozen runpy>", line 88 in _run_code\n')
    assert read_fatal_stack(dump, str(tmp_path)) == ["train.py:10", "train.py:27"]
    dump.write_text(dump.read_text().replace("Thread 0x00007f2dac8d56c0", "Current thread 0x00007f2dac8d56c0"))
    assert read_fatal_stack(dump, str(tmp_path)) == ["train.py:30"]

def test_a_rank_killed_by_a_signal_is_named_at_the_call_faulthandler_saw_it_in():
    crashed = _killed(1, [record(1, site="train.py:9")], "SIGSEGV", None)
    crashed.fatal_stack = ["train.py:4", "train.py:11", "train.py:15"]
    views = {0: view(0, [record(1, site="train.py:9"), record(2, site="train.py:9", state="entered")], alive=True),
             1: crashed}
    (finding,) = diagnose(views, trigger="failure", now=20.0)["findings"]
    assert finding["category"] == "rank_crashed" and finding["locations"] == {"1": "train.py:4"}
    assert "inside a call made at train.py:4" in finding["message"]
    assert "train.py:4 <- train.py:11 <- train.py:15" in finding["message"]
    assert "PYTHONFAULTHANDLER" not in finding["suggestion"] and finding["details"]["fatal_stack"] == {"1": crashed.fatal_stack}
    # Without a dump (an older gradsync, a script that took faulthandler over): the last recorded position.
    crashed.fatal_stack = None
    (finding,) = diagnose(views, trigger="failure", now=20.0)["findings"]
    assert finding["locations"] == {"1": last_position(crashed)} != {"1": "train.py:4"}
    assert "PYTHONFAULTHANDLER" in finding["suggestion"]



def test_a_native_crash_inside_a_one_line_wrapper_is_named_at_the_wrappers_caller(tmp_path):
    # decode() is one statement around ctypes: its caller, under the condition that chose the
    # record, is the line to look at. A helper that does more than forward is named itself.
    (tmp_path / "train.py").write_text(NATIVE_CRASH)
    crashed = _killed(1, [record(1, site="train.py:9")], "SIGSEGV", None)
    crashed.snapshot["cwd"] = str(tmp_path)
    crashed.fatal_stack = ["train.py:4", "train.py:11", "train.py:15"]
    views = {0: view(0, [record(1, site="train.py:9"), record(2, site="train.py:9", state="entered")], alive=True),
             1: crashed}
    (finding,) = diagnose(views, trigger="failure", now=20.0)["findings"]
    assert finding["locations"] == {"1": "train.py:11"}
    assert "inside a call made at train.py:11" in finding["message"]
    (tmp_path / "train.py").write_text(NATIVE_CRASH.replace("def decode(record):\n", "def decode(record):\n    record = bytes(record)\n"))
    crashed.fatal_stack = ["train.py:5", "train.py:12", "train.py:16"]
    (finding,) = diagnose(views, trigger="failure", now=20.0)["findings"]
    assert finding["locations"] == {"1": "train.py:5"}

def _run(tmp_path, script: str, **env: str) -> tuple[subprocess.CompletedProcess, dict]:
    (tmp_path / "train.py").write_text(script)
    done = subprocess.run([sys.executable, "-m", "gradsync", "run", "--standalone", "--nproc-per-node", "2",
                           "--run-dir", "run", "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=180,
                          env={**os.environ, **env})
    return done, json.loads((tmp_path / "run" / "diagnosis.json").read_text())


@pytest.mark.launches
def test_a_native_crash_under_gradsync_run_is_named_at_the_users_line_that_made_the_call(tmp_path):
    done, diagnosis = _run(tmp_path, NATIVE_CRASH)
    assert done.returncode == 1, done.stderr
    finding = diagnosis["findings"][0]
    assert finding["category"] == "rank_crashed" and finding["ranks"] == [1], finding
    # decode() only forwards to ctypes: named at its caller, the stack at the signal in the message.
    assert finding["locations"] == {"1": "train.py:11"} and "train.py:4 <- train.py:11" in finding["message"]
    assert "Fatal Python error" not in done.stdout + done.stderr  # the dump went to the run folder only
    assert "Current thread" in (tmp_path / "run" / "workers" / "attempt0" / "fatal-rank1.txt").read_text()



# Rank 1's DataLoader worker reads address 0 through ctypes in the dataset: the worker dies of
# SIGSEGV (torch's own handler says so on stderr), and the rank raises "DataLoader worker ...
# exited unexpectedly" at its loop.
LOADER_WORKER_CRASH = """\
import ctypes
import torch, torch.distributed as dist
class Records(torch.utils.data.Dataset):
    def __len__(self):
        return 8
    def __getitem__(self, i):
        if dist.get_rank() == 1 and i == 5:
            ctypes.string_at(0)                 # line 8: the native call that crashes
        return torch.ones(4)
dist.init_process_group("gloo")
for batch in torch.utils.data.DataLoader(Records(), batch_size=2, num_workers=1):   # line 11
    dist.all_reduce(batch)
dist.destroy_process_group()
"""


@pytest.mark.launches
def test_a_data_loader_workers_native_crash_is_named_at_the_datasets_line(tmp_path):
    done, diagnosis = _run(tmp_path, LOADER_WORKER_CRASH)
    assert done.returncode == 1, done.stderr
    finding = diagnosis["findings"][0]
    assert finding["category"] == "rank_crashed" and finding["ranks"] == [1], finding
    assert finding["locations"] == {"1": "train.py:8"}, finding
    # What the rank raised, wherever torch's SIGCHLD handler made it raise (its loop or its all_reduce).
    # What the rank raised first varies under load: torch's words, or the dying worker's queue's error.
    assert "inside a call made at train.py:8" in finding["message"], finding
    # The worker still dies as it would: torch's handler speaks after faulthandler's dump.
    assert "Unexpected segmentation fault encountered in worker" in done.stdout + done.stderr

@pytest.mark.launches
def test_a_faulthandler_the_user_asked_for_is_left_to_write_where_they_asked(tmp_path):
    """The healthy twin: PYTHONFAULTHANDLER=1 (faulthandler on stderr before the script) and a script
    that enables it itself both keep their output, under gradsync run as under plain Python."""
    own = textwrap.dedent("""\
        import faulthandler, sys, torch, torch.distributed as dist
        faulthandler.enable()
        dist.init_process_group("gloo")
        dist.all_reduce(torch.ones(1))
        if dist.get_rank() == 1: faulthandler.dump_traceback(sys.stderr)
        dist.destroy_process_group()
        """)
    done, diagnosis = _run(tmp_path, own)
    assert done.returncode == 0 and diagnosis["status"] == "ok", done.stderr
    # One writer: two ranks' dumps written at once interleave their lines on the job's stderr.
    assert done.stderr.count('train.py", line 5 in <module>') == 1, done.stderr
    done, diagnosis = _run(tmp_path, NATIVE_CRASH, PYTHONFAULTHANDLER="1")
    assert done.returncode == 1 and diagnosis["findings"][0]["ranks"] == [1]
    assert "Fatal Python error: Segmentation fault" in done.stderr
    assert not (tmp_path / "run" / "workers" / "attempt0" / "fatal-rank1.txt").exists()  # not gradsync's to take


def test_an_extra_call_at_a_line_both_ranks_use_is_named_before_the_backends_size_abort_far_on():
    # Both ranks log a 0-d value at log.py:44 at step 1; at step 3 only rank 0 does, and that extra
    # one pairs silently with rank 1's next 0-d eval all_reduce, each later one meeting the other
    # rank's previous, until the 2-element totals meet rank 0's 0-d one: Gloo aborts rank 0 on the
    # sizes. The call the ranks part at is rank 0's extra log, not where the sizes disagree.
    scalar, pair = "float32[] op=SUM", "float32[2] op=SUM"
    both = [record(1, signature=scalar, site="log.py:44"), record(2, signature=scalar, site="eval.py:40")]
    rank0 = both + [record(3, signature=scalar, site="log.py:44"), record(4, signature=scalar, site="eval.py:40"),
                    record(5, signature=scalar, site="eval.py:40", state="entered")]
    rank1 = both + [record(3, signature=scalar, site="eval.py:40"), record(4, signature=scalar, site="eval.py:40"),
                    record(5, signature=pair, site="eval.py:46", state="entered")]
    views = {0: view(0, rank0, signal="SIGABRT", exitcode=-6), 1: view(1, rank1, alive=True)}
    views[0].last_words = classify(GLOO_MISMATCH)
    diagnosis = diagnose(views, trigger="failure", now=200.0)
    finding = diagnosis["findings"][0]
    assert finding["category"] == "collective_mismatch" and finding["ranks"] == [0], finding
    assert finding["locations"] == {"0": "log.py:44", "1": "eval.py:40"}, finding
    assert "rank 0 had called an extra collective" in finding["message"] and "until #5 no longer matched" in finding["message"]
    assert "The backend on rank 0 said so as it aborted" in finding["message"], finding["message"]


def test_the_same_collective_called_from_each_ranks_own_branch_is_no_extra_call():
    scalar = "float32[] op=SUM"
    rank0 = [record(1, signature=scalar, site="a.py:10"), record(2, op="broadcast", signature=scalar, site="a.py:20"),
             record(3, signature="float32[4] op=SUM", site="a.py:30", state="entered")]
    rank1 = [record(1, signature=scalar, site="a.py:10"), record(2, op="broadcast", signature=scalar, site="a.py:22"),
             record(3, signature="float32[8] op=SUM", site="a.py:30", state="entered")]
    diagnosis = diagnose({0: view(0, rank0, alive=True), 1: view(1, rank1, alive=True)}, trigger="stall", now=200.0)
    finding = diagnosis["findings"][0]
    assert finding["category"] == "shape_mismatch" and "extra collective" not in finding["message"], finding
    assert finding["locations"] == {"0": "a.py:30", "1": "a.py:30"}, finding



def test_a_data_loader_workers_crash_in_a_one_line_wrapper_is_named_at_the_wrappers_caller(tmp_path):
    # The dataset calls decode() (one statement around ctypes) at line 11: as for a rank's own
    # crash, the caller is named, not the wrapper.
    (tmp_path / "train.py").write_text(NATIVE_CRASH)
    raised = exception("DataLoader worker (pid 812) is killed by signal: Segmentation fault.", location="train.py:15")
    failed = view(1, [record(1, site="train.py:9")], exit=raised, exitcode=1)
    failed.snapshot["cwd"] = str(tmp_path)
    failed.loader_worker_fatal_stack = ["train.py:4", "train.py:11"]
    views = {0: view(0, [record(1, site="train.py:9"), record(2, site="train.py:9", state="entered")], alive=True),
             1: failed}
    (finding,) = diagnose(views, trigger="failure", now=20.0)["findings"]
    assert finding["category"] == "rank_crashed" and finding["locations"] == {"1": "train.py:11"}, finding
    assert "inside a call made at train.py:11" in finding["message"]
