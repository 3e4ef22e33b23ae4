"""`gradsync run --doctor-steps K` on pipelines with data parallelism (4 ranks: 2 stages x 2
replicas, gradsync's pp+ddp): the replicas of each stage are compared among themselves, never
with the other stage's ranks, which hold another model under the same parameter names. A
replica that drifts is named; a healthy job gets no finding. The rules are tested on hand-made
facts in tests/run/scriptcheck/ (test_replicas, test_update_differs, test_pipeline_messages)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
JOB = REPO_ROOT / "tests/run/pipeline_trainer_job.py"

pytestmark = [pytest.mark.launches, pytest.mark.timeout(600)]


def _doctor(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    done = subprocess.run(
        [sys.executable, "-m", "gradsync", "run", "--standalone", "--nproc-per-node", "4", "--doctor-steps", "3",
         "--stall-timeout", "60", "--run-dir", str(tmp_path / "run"), str(JOB), *args],
        capture_output=True, text=True, timeout=280, cwd=REPO_ROOT, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
    )
    return done, json.loads((tmp_path / "run" / "diagnosis.json").read_text())


def test_a_healthy_pipeline_with_replicas_gets_no_finding_though_its_stages_differ(tmp_path):
    done, diagnosis = _doctor(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert [f["category"] for f in diagnosis["findings"] if f["severity"] == "error"] == [], diagnosis["findings"]


def test_a_replica_of_a_stage_that_drifts_is_named_against_its_own_stage_s_replicas(tmp_path):
    done, diagnosis = _doctor(tmp_path, "--drift")
    errors = [f for f in diagnosis["findings"] if f["severity"] == "error"]
    assert done.returncode == 1 and len(errors) == 1, done.stdout + done.stderr
    (finding,) = errors
    assert finding["category"] == "update_differs" and finding["ranks"] == [2], finding
    assert "rank 2 changed them after optimizer step 1" in finding["message"], finding
