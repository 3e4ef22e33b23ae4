"""The main job: `gradsync demo` trains the digits CNN with 2 processes through torchrun's agent."""

import json
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent


def test_demo_reaches_95_percent_and_reports(tmp_path):
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [str(BIN / "gradsync"), "demo", "--run-dir", str(run_dir)],
        cwd=tmp_path, capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    accuracy = [row["eval/accuracy"] for row in rows if "eval/accuracy" in row]
    assert accuracy[-1] >= 0.95, accuracy
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    for line in ("test accuracy", "samples/s", "exposed communication", "processes"):
        assert line in done.stdout
    assert "│ processes             │                  2 │" in done.stdout
    assert "[gradsync rank 0] step " in done.stderr, "progress is reported while training"


def test_module_entry_point_and_help():
    done = subprocess.run([sys.executable, "-m", "gradsync", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "demo" in done.stdout
    done = subprocess.run([sys.executable, "-m", "gradsync", "demo", "--nproc-per-node", "0"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "at least 1" in done.stderr
