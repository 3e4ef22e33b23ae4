"""`gradsync doctor --steps K`'s second pass: where the optimizer's settings parted across ranks and no
recorded write explains it (a param_group entry assigned from a rank's own count), the script runs again
up to that window with its lines traced there, and the finding names the line (tests/run/doctor_zoo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import REPO_ROOT

ZOO = "tests/run/doctor_zoo"
pytestmark = [pytest.mark.launches, pytest.mark.timeout(400)]


def _doctor(script: str, run_dir: Path) -> tuple[subprocess.CompletedProcess, dict]:
    done = subprocess.run(
        [sys.executable, "-m", "gradsync", "doctor", "--nproc-per-node", "2", "--steps", "6", "--run-dir", str(run_dir),
         f"{ZOO}/{script}.py"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return done, json.loads((run_dir / "diagnosis.json").read_text())


def _line(script: str, tag: str) -> str:
    text = (REPO_ROOT / ZOO / f"{script}.py").read_text().splitlines()
    (number,) = [i for i, line in enumerate(text, 1) if line.rstrip().endswith(f"# doctor: {tag}")]
    return f"{ZOO}/{script}.py:{number}"


def test_a_learning_rate_set_from_each_ranks_own_count_is_traced_to_its_line(tmp_path):
    done, diagnosis = _doctor("warmup_by_local_tokens", tmp_path / "run")
    assert done.returncode == 1, done.stderr
    (finding,) = [f for f in diagnosis["findings"] if f["category"] == "state_parted_at_line"]
    cause = _line("warmup_by_local_tokens", "cause")
    assert set(finding["locations"].values()) == {cause} and "(lr: rank 0 " in finding["message"]
    assert "update_differs" not in {f["category"] for f in diagnosis["findings"]}  # the guess, replaced
    assert "tracing that window line by line" in done.stderr and (tmp_path / "run" / "second-pass" / "diagnosis.json").exists()


def test_the_same_warmup_from_the_jobs_count_needs_no_second_pass(tmp_path):
    done, diagnosis = _doctor("healthy_warmup_by_global_tokens", tmp_path / "run")
    assert done.returncode == 0 and diagnosis["findings"] == [], done.stderr
    assert not (tmp_path / "run" / "second-pass").exists()
