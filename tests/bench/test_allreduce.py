"""`gradsync bench allreduce`: sizes, bus bandwidth arithmetic, and the JSON a real 2-rank sweep prints."""

import json
import os
import subprocess
import sys

import pytest

from gradsync.bench.allreduce import SweepConfig, parse_size, render
from gradsync.metrics.timing import bus_factor
from gradsync.errors import ConfigError


def test_sizes_parse_in_binary_units():
    assert parse_size("1K") == 1024 and parse_size("256M") == 256 << 20 and parse_size("4096") == 4096
    assert parse_size("2MiB") == 2 << 20 and parse_size("1g") == 1 << 30
    for bad in ("", "K", "-1K", "1T", "0"):
        with pytest.raises(ConfigError, match="size"):
            parse_size(bad)


def test_sweep_sizes_double_from_min_to_max_and_respect_the_element_size():
    assert SweepConfig(min_bytes=1024, max_bytes=8192).sizes() == [1024, 2048, 4096, 8192]
    assert SweepConfig(min_bytes=6, max_bytes=24, dtype="float64").sizes() == [8, 8, 24]
    with pytest.raises(ConfigError, match="Gloo has no 'avg'"):
        SweepConfig(op="avg")
    with pytest.raises(ConfigError, match="min"):
        SweepConfig(min_bytes=4096, max_bytes=1024)


def test_bus_bandwidth_factor_follows_nccl_tests():
    assert bus_factor(2) == 1.0 and bus_factor(4) == 1.5 and bus_factor(8) == 1.75 and bus_factor(1) == 1.0


def _run_cli(*args):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "gradsync", "bench", "allreduce", *args],
        capture_output=True, text=True, env=env, timeout=120,
    )


@pytest.mark.launches
def test_a_real_sweep_prints_the_documented_json(tmp_path):
    output = tmp_path / "sweep.json"
    done = _run_cli("--max-bytes", "64K", "--factor", "4", "--iters", "5", "--json", "--output", str(output))
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(done.stdout.strip().splitlines()[-1])
    assert data == json.loads(output.read_text())
    assert data["world_size"] == 2 and data["backend"] == "gloo" and data["dtype"] == "float32"
    assert [r["bytes"] for r in data["results"]] == [1024, 4096, 16384, 65536]
    for r in data["results"]:
        assert r["time_s"] > 0
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / r["time_s"] / 1e9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"])  # 2(n-1)/n = 1 for two ranks
    assert "busbw (GB/s)" in render(data)


@pytest.mark.launches
def test_bad_options_are_refused_before_any_worker_starts():
    done = _run_cli("--max-bytes", "lots")
    assert done.returncode == 2 and "size 'lots'" in done.stderr
    done = _run_cli("--nproc-per-node", "1")
    assert done.returncode == 2 and "at least 2" in done.stderr
