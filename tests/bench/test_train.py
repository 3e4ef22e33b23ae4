"""`gradsync bench train`: the JSON report and the picture, from real 1- and 2-worker jobs."""

import json
import os
import subprocess
import sys

import pytest

from gradsync.bench.train import parse_configs
from gradsync.errors import ConfigError


def test_configs_are_checked():
    assert parse_configs("fp32, int8,auto") == ["fp32", "int8", "auto"]
    for bad in ("", "fp32,zip", ","):
        with pytest.raises(ConfigError, match="comma-separated"):
            parse_configs(bad)


def test_a_small_benchmark_reports_every_config_and_draws_it(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "gradsync", "bench", "train", "--workload", "mlp", "--configs", "fp32,int8",
         "--steps", "6", "--warmup", "2", "--batch-size", "16", "--json", "--output-dir", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == json.loads((tmp_path / "report.json").read_text())
    assert (tmp_path / "report.png").stat().st_size > 10_000
    page = (tmp_path / "report.html").read_text()
    assert "data:image/png;base64," in page and "samples/s/worker" in page
    assert report["allreduce"] and report["allreduce"][-1]["bytes"] == 64 << 20
    assert report["workload"] == "mlp" and report["world_size"] == 2 and report["single_worker_samples_per_s"] > 0
    assert [r["config"] for r in report["results"]] == ["fp32", "int8"]
    assert report["single_worker_samples_per_s"] == pytest.approx(sum(report["single_worker_runs"]) / 2)
    for r in report["results"]:
        assert r["samples_per_s_per_worker"] > 0 and 0 < r["exposed_comm_share"] < 1
        assert r["scaling_efficiency"] == pytest.approx(r["samples_per_s_per_worker"] / report["single_worker_samples_per_s"])
        assert r["final_loss"] > 0 and len(r["loss_curve"]) >= 1
    fp32, int8 = report["results"]
    assert int8["comm_bytes_per_step"] < fp32["comm_bytes_per_step"] / 3


def test_the_table_says_when_auto_raised_accumulation():
    from gradsync.bench.train import render

    def row(config, chosen):
        return {"config": config, "samples_per_s_per_worker": 20.0, "scaling_efficiency": 0.8, "exposed_comm_share": 0.1,
                "comm_bytes_per_step": 2**20, "final_loss": 1.0, "chosen": chosen}

    report = {"workload": "resnet18", "world_size": 2, "batch_size_per_worker": 32, "single_worker_samples_per_s": 25.0,
              "results": [row("fp32", None), row("auto", {"compression": "bf16", "accumulation_steps": 1}),
                          row("auto", {"compression": "powersgd", "accumulation_steps": 4})]}
    lines = render(report).splitlines()
    assert lines[2].endswith("1.0000  ") and lines[3].endswith("  bf16") and lines[4].endswith("  powersgd, accumulation 4")
