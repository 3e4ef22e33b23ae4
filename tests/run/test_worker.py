"""The worker runs the script as Python would, and keeps watching it wherever the script goes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gradsync.rundir.records import Snapshot
from tests.harness import REPO_ROOT

pytestmark = pytest.mark.launches  # every test here starts processes

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
