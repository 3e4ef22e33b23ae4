"""The worker runs the script as Python would, keeps watching it wherever the script goes, and what
it does around the script never changes how the script runs or ends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from gradsync.profiling.capture import ProfileWindow
from gradsync.run import worker
from gradsync.run.collectives import CollectiveRecorder
from gradsync.run.options import RunOptions
from gradsync.rundir import RunDir
from gradsync.rundir.records import Snapshot
from tests.harness import REPO_ROOT
from tests.run.side_by_side import gradsync_warnings, outcome

GRADSYNC = Path(sys.executable).parent / "gradsync"

WANDERING = """
    import os
    import time
    import torch.distributed as dist

    print(f"file is absolute: {os.path.isabs(__file__)}")    # not flushed: the console must get it anyway
    os.chdir({elsewhere!r})                                  # Hydra's job.chdir does this
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        dist.barrier()                                       # rank 0 alone: the job hangs
    else:
        time.sleep(120)
"""


@pytest.mark.launches
def test_a_script_that_changes_directory_and_hangs_is_still_diagnosed_with_its_output(tmp_path):
    # The run folder is given relative: the workers' records must still land in it after chdir,
    # and what the script printed before the hang must reach the console and the ranks' logs.
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "train.py").write_text(textwrap.dedent(WANDERING).replace("{elsewhere!r}", repr(str(tmp_path / "elsewhere"))))
    done = subprocess.run(
        [str(GRADSYNC), "run", "--standalone", "--nproc-per-node", "2", "--stall-timeout", "4", "--run-dir", "run",
         "train.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 1, done.stdout + done.stderr
    diagnosis = json.loads((tmp_path / "run" / "diagnosis.json").read_text())
    assert diagnosis["trigger"] == "stall" and set(diagnosis["ranks"]) == {"0", "1"}, diagnosis
    assert not (tmp_path / "elsewhere" / "run").exists()
    assert done.stdout.count("file is absolute: True") == 2, done.stdout
    snapshot = json.loads((tmp_path / "run" / "workers" / "attempt0" / "rank1.json").read_text())
    assert set(snapshot) == Snapshot.__required_keys__ | Snapshot.__optional_keys__, "records.Snapshot declares what readers get"
    for rank in (0, 1):
        assert "file is absolute: True" in (tmp_path / "run" / "workers" / "attempt0" / f"rank{rank}.log").read_text()


ENDS_WITH_END_PROCESS = """
    import atexit
    import torch.distributed as dist
    from gradsync.distributed import end_process

    atexit.register(print, "exit handlers ran")
    dist.init_process_group("gloo")
    dist.all_reduce(__import__("torch").ones(1))
    end_process(3 if dist.get_rank() == 1 else 0)              # how gradsync's demo ends its workers
"""


@pytest.mark.launches
def test_a_script_that_ends_with_end_process_still_leaves_how_each_rank_ended(tmp_path):
    # end_process ends a process on the spot (os._exit); inside gradsync run the worker must still
    # write each rank's exit record, which the diagnosis reads for the rank that failed.
    (tmp_path / "train.py").write_text(textwrap.dedent(ENDS_WITH_END_PROCESS))
    done = subprocess.run(
        [str(GRADSYNC), "run", "--standalone", "--nproc-per-node", "2", "--run-dir", "run", "train.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 1, done.stdout + done.stderr
    attempt = tmp_path / "run" / "workers" / "attempt0"
    ends = [json.loads((attempt / f"rank{rank}.exit.json").read_text())["exit"] for rank in (0, 1)]
    assert [(end["status"], end["code"]) for end in ends] == [("finished", 0), ("exit_code", 3)], ends
    assert done.stdout.count("exit handlers ran") == 2, done.stdout


# -- do no harm: what the worker does around the script (gradsync.run.harmless) -------------------


def _two_steps_with_a_closure() -> tuple[list[float], list]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    # A class of its own: the step counter wraps an optimizer class's step for good.
    optimizer = type("SGD", (torch.optim.SGD,), {})(model.parameters(), lr=0.1)

    def closure():
        optimizer.zero_grad()
        loss = model(torch.ones(2, 3)).pow(2).mean()
        loss.backward()
        return loss

    return [optimizer.step(closure).item() for _ in range(2)], [p.tolist() for p in model.parameters()]


def test_an_optimizer_step_returns_as_without_gradsync_when_counting_it_fails(tmp_path, monkeypatch, capsys):
    plain = outcome(_two_steps_with_a_closure)
    # The counter hands each step to a profile window, which fails for real when the run folder
    # it writes the trace into is a file.
    (tmp_path / "run").write_text("not a folder")
    window = ProfileWindow(1, 1, tmp_path / "run", rank=0)
    recorder = CollectiveRecorder()
    monkeypatch.setattr(torch.optim.Optimizer, "_patch_step_function", torch.optim.Optimizer._patch_step_function)
    worker._count_optimizer_steps(recorder, window)
    counted = outcome(_two_steps_with_a_closure)
    assert counted == plain and plain[0] == "returned", (plain, counted)
    warnings = gradsync_warnings(capsys.readouterr().err)
    assert len(warnings) == 1 and "optimizer step counter failed" in warnings[0], warnings
    assert recorder.optimizer_steps == 2, "counting goes on past the window's failure"


def test_the_exit_record_not_written_does_not_change_how_the_rank_ends(tmp_path, capsys):
    identity = {"rank": 0, "local_rank": 0, "world_size": 1, "local_world_size": 1, "attempt": 0, "host": "h", "pid": 1,
                "started": 0.0, "cwd": str(tmp_path), "target": "train.py", "round_store": ":"}
    writer = worker.SnapshotWriter(CollectiveRecorder(), RunOptions(run_dir=tmp_path), identity, flight_on=False)
    # The rank's folder is a file (a vanished or full disk reads the same to the writer).
    RunDir(tmp_path).exit_record(0, 0).parent.parent.mkdir(parents=True)
    RunDir(tmp_path).exit_record(0, 0).parent.write_text("not a folder")
    writer.finish({"status": "finished", "code": 0})
    warnings = gradsync_warnings(capsys.readouterr().err)
    assert len(warnings) == 1 and "snapshot and exit records failed (FileExistsError" in warnings[0], warnings


class UnprintableError(Exception):
    """An exception whose message cannot be made: __str__ reads what __init__ never set."""

    def __str__(self) -> str:
        return self.detail


def test_an_exception_that_cannot_be_printed_is_described_as_python_prints_it():
    try:
        raise UnprintableError()  # line: unprintable
    except UnprintableError as error:
        described = worker.describe_exception(error)
    line = next(i for i, text in enumerate(open(__file__), 1) if text.rstrip().endswith("# line: unprintable"))
    assert described["type"] == "UnprintableError" and described["message"] == "<exception str() failed>"
    assert described["location"].endswith(f"tests/run/test_worker.py:{line}")
    assert described["traceback"].rstrip().endswith("UnprintableError: <exception str() failed>")
