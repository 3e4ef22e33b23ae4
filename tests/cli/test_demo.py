"""The main job: `gradsync demo` trains the digits CNN with 2 processes under `gradsync run`."""

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gradsync.cli import demo
from gradsync.run import launcher
from gradsync.run.output_filter import is_backend_log_line
from gradsync.rundir.records import METRICS_KEYS
from tests.timed_findings import untimed, untimed_warning_lines

BIN = Path(sys.executable).parent


@pytest.mark.launches
def test_demo_reaches_95_percent_and_reports(demo_run):
    run_dir, done = demo_run.run_dir, demo_run
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {key for row in rows for key in row} - METRICS_KEYS == {"loss", "eval/accuracy"}, "MetricsRow declares the rest"
    accuracy = [row["eval/accuracy"] for row in rows if "eval/accuracy" in row]
    assert accuracy[-1] >= 0.95, accuracy
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    for line in ("test accuracy", "samples/s", "exposed communication", "processes"):
        assert line in done.stdout
    assert "│ processes             │                  2 │" in done.stdout
    assert "[gradsync rank 0] step " in done.stderr, "progress is reported while training"
    diagnosis = json.loads((run_dir / "diagnosis.json").read_text())
    assert diagnosis["status"] == "ok" and untimed(diagnosis["findings"]) == [], diagnosis
    breakdowns = [json.loads((run_dir / "profile" / f"rank{r}.breakdown.json").read_text()) for r in (0, 1)]
    assert all([s["step"] for s in b["steps"]] == [20, 21, 22] for b in breakdowns), "--profile-steps 20:22 by default"
    assert set(breakdowns[0]["annotated_phases"]) == {"data", "forward", "backward", "optimizer"}, "the trainer marks its phases"
    for rank in (0, 1):  # gradsync run logs each rank's machine, once per snapshot
        readings = [json.loads(line) for line in (run_dir / "workers" / "attempt0" / f"system-rank{rank}.jsonl").read_text().splitlines()]
        assert readings and all(r["rss_mb"] > 50 and "net_sent_mbps" in r for r in readings)
    assert "gradsync run: ok: 2 ranks finished" in done.stderr
    assert untimed_warning_lines(done.stderr.lower(), "warning") == [] and "FAILED" not in done.stderr, done.stderr
    # No backend noise: the profiler's kineto lines (steps 20:22 are profiled) and torch's own
    # log lines stay in the ranks' logs; the paths printed can be copied whole.
    printed = (done.stdout + done.stderr).splitlines()
    assert not [line for line in printed if is_backend_log_line(line.encode())], done.stderr
    assert "profiler_start" in (run_dir / "workers" / "attempt0" / "rank0.log").read_text()
    assert f"tensorboard --logdir {run_dir}" in printed
    assert f"report: {run_dir / 'report.html'}" in done.stdout
    assert f"gradsync demo: watch it from another shell: gradsync status --watch {run_dir}" in done.stdout


def _params_sha256(output: str) -> str:
    match = re.search(r"^params sha256: ([0-9a-f]{64})$", output, re.MULTILINE)
    assert match, output
    return match[1]


# One demo's hang guard: a demo of 2-3 epochs takes 20-30 s on an idle 2-core machine. A test that
# runs two gets their guards as its own (pytest's default, 300 s, was 4.9x the 61 s it took).
DEMO_TIMEOUT_S = 180


@pytest.mark.launches
@pytest.mark.timeout(2 * DEMO_TIMEOUT_S + 60)
def test_a_demo_killed_and_restarted_ends_with_the_same_parameters(tmp_path):
    def demo_run(*options: str) -> subprocess.CompletedProcess:
        done = subprocess.run(
            [str(BIN / "gradsync"), "demo", "--epochs", "3", *options],
            cwd=tmp_path, capture_output=True, text=True, timeout=DEMO_TIMEOUT_S,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done

    # The README's example: the restarted workers resume from the last checkpoint (step 14), so
    # equal hashes mean the resumed run ended bitwise where an uninterrupted one does.
    plain = demo_run("--run-dir", str(tmp_path / "plain"))
    faulted = demo_run("--run-dir", str(tmp_path / "faulted"), "--checkpoint-dir", str(tmp_path / "ckpt"), "--resume", "auto",
                       "--checkpoint-every", "7", "--max-restarts", "1", "--inject-fault", "kill:rank=1:step=20")
    assert "injected fault" in faulted.stderr
    assert f"resumed from {tmp_path / 'ckpt' / 'step-000000014'} (step 14)" in faulted.stdout, faulted.stdout
    assert _params_sha256(faulted.stdout) == _params_sha256(plain.stdout)


def _demo_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo.add_parser(parser.add_subparsers())
    return parser.parse_args(["demo", *argv])


def test_demo_runs_its_workers_under_gradsync_run_with_restarts_faults_and_checkpoint_options():
    args = _demo_args(
        "--nproc-per-node", "3", "--max-restarts", "2", "--inject-fault", "kill:rank=1:step=5",
        "--inject-fault", "exit:rank=2:step=9:code=3:attempt=1", "--epochs", "1",
        "--checkpoint-dir", "ckpt", "--resume", "auto", "--checkpoint-every", "10",
    )
    argv = demo.launcher_argv(args, Path("runs/x"))
    run = launcher.build_parser().parse_args(argv)
    assert (run.standalone, run.nproc_per_node, run.max_restarts, run.run_dir) == (True, "3", 2, "runs/x")
    assert run.profile_steps == "20:22", "the demo profiles a few steps for its report by default"
    assert demo.launcher_argv(_demo_args("--profile-steps", "none"), Path("r")).count("--profile-steps") == 0
    assert run.inject_fault == ["kill:rank=1:step=5", "exit:rank=2:step=9:attempt=1:code=3"]
    assert (run.module, run.training_script) == (True, "gradsync.demo.digits")
    assert run.training_script_args == [
        "--epochs", "1", "--checkpoint-dir", "ckpt", "--resume", "auto", "--checkpoint-every", "10",
    ], "the workers' trainer inherits the launcher's --run-dir (given once); checkpoint options reach them verbatim"
    assert "--max-restarts" not in run.training_script_args and "--inject-fault" not in run.training_script_args


@pytest.mark.launches
def test_module_entry_point_and_help():
    done = subprocess.run([sys.executable, "-m", "gradsync", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "demo" in done.stdout
    done = subprocess.run([sys.executable, "-m", "gradsync", "demo", "--nproc-per-node", "0"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "at least 1" in done.stderr
    done = subprocess.run([sys.executable, "-m", "gradsync", "demo", "--inject-fault", "kill:rank=1"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "step missing" in done.stderr


@pytest.mark.launches
@pytest.mark.timeout(2 * DEMO_TIMEOUT_S + 60)
def test_the_demo_trains_sharded_and_tensor_parallel(tmp_path):
    """`gradsync demo --parallel fsdp|tp`: the same job under FSDP2 and tensor parallelism, whose
    throughput counts each sample once (a tensor-parallel pair trains on the same batches)."""
    steps = {}
    for strategy in ("fsdp", "tp"):
        done = subprocess.run(
            [str(BIN / "gradsync"), "demo", "--epochs", "1", "--parallel", strategy, "--profile-steps", "none",
             "--run-dir", str(tmp_path / strategy)],
            cwd=tmp_path, capture_output=True, text=True, timeout=DEMO_TIMEOUT_S,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert "ok: 2 ranks finished" in done.stderr + done.stdout
        rows = [json.loads(line) for line in (tmp_path / strategy / "metrics.jsonl").read_text().splitlines()]
        steps[strategy] = rows
    samples = {strategy: sum(row["samples"] for row in rows) for strategy, rows in steps.items()}
    # One epoch of the same training set: FSDP splits it over 2 ranks (padding at most one sample),
    # TP's ranks share it; counted twice, TP's would be twice FSDP's.
    assert samples["tp"] <= samples["fsdp"] <= samples["tp"] + 1
    assert 2 * steps["tp"][0]["samples"] == steps["fsdp"][0]["samples"], "one data-parallel rank: half the global batch"
    assert all(row["reductions"] == 1 for row in steps["fsdp"]) and all(row["reductions"] == 0 for row in steps["tp"])


@pytest.mark.launches
@pytest.mark.timeout(DEMO_TIMEOUT_S + 60)
def test_the_demo_trains_as_a_pipeline_to_the_demos_accuracy(tmp_path):
    """`gradsync demo --parallel pp`: the CNN cut into two stages, one per process, trained to the
    accuracy the DDP demo is held to, with the bubble measured on every step."""
    done = subprocess.run(
        [str(BIN / "gradsync"), "demo", "--parallel", "pp", "--profile-steps", "none", "--run-dir", str(tmp_path / "pp")],
        cwd=tmp_path, capture_output=True, text=True, timeout=DEMO_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [json.loads(line) for line in (tmp_path / "pp" / "metrics.jsonl").read_text().splitlines()]
    accuracy = [row["eval/accuracy"] for row in rows if "eval/accuracy" in row]
    assert accuracy[-1] >= 0.95, accuracy
    steps = [row for row in rows if "pipeline_bubble_share" in row]
    assert len(steps) == len([row for row in rows if "samples_per_s" in row]) > 0
    assert all(0 < row["pipeline_bubble_share"] < 1 and row["p2p_bytes"] > 0 for row in steps)
    assert "bubble" in done.stderr + done.stdout
