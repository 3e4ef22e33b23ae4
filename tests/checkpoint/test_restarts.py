"""A SIGTERM to `gradsync run`'s launcher: real processes, real signals, no mocks.

The job saves a final checkpoint and exits with 143; the same command launched again resumes
from it and ends with the same parameters, bit for bit, as a run that never stopped. (SIGKILL
at random steps and during checkpoint writes, SIGSTOP, hosts cut off or killed, a full disk and
damaged checkpoints are test_chaos's, and `make chaos`'s many times over.)
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness import REPO_ROOT

pytestmark = pytest.mark.launches  # every test here starts processes

SCRIPT = "tests/checkpoint/train_script.py"


@pytest.fixture
def reference_sha(uninterrupted) -> str:
    return uninterrupted["sha256"]


def _command(tmp_path: Path, *gradsync_options: str, script_options: tuple[str, ...] = ()) -> list[str]:
    return [
        sys.executable, "-m", "gradsync", "run", "--standalone", "--nproc-per-node", "2",
        "--run-dir", str(tmp_path / "run"), *gradsync_options, SCRIPT,
        "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), *script_options,
    ]


def _run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def _final_sha(tmp_path: Path) -> list[str]:
    return [json.loads((tmp_path / "out" / f"rank{r}.json").read_text())["sha256"] for r in range(2)]


def test_sigterm_to_the_launcher_saves_a_final_checkpoint(tmp_path, reference_sha):
    launcher = subprocess.Popen(
        _command(tmp_path, script_options=("--step-delay", "0.4")), cwd=REPO_ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    first = tmp_path / "ckpt" / "step-000000003" / "manifest.json"
    deadline = time.monotonic() + 60
    while not first.exists() and time.monotonic() < deadline and launcher.poll() is None:
        time.sleep(0.1)
    assert first.exists(), "the run never committed its first checkpoint"
    launcher.send_signal(signal.SIGTERM)
    out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 143, out + err
    assert "Traceback" not in err, err
    steps = sorted(int(p.parent.name.removeprefix("step-")) for p in (tmp_path / "ckpt").glob("step-*/manifest.json"))
    stopped_at = re.search(r"stopped by SIGTERM after saving step (\d+)", err)
    assert stopped_at, err
    assert steps[-1] == int(stopped_at[1]) > 3, steps  # the final save is the newest committed one

    done = _run(_command(tmp_path))  # the same command again, in the same run directory
    assert done.returncode == 0, done.stdout + done.stderr
    assert "held an earlier launch's records; moved them to" in done.stderr
    assert f"(step {steps[-1]})" in done.stderr
    assert _final_sha(tmp_path) == [reference_sha] * 2
