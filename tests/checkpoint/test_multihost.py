"""Two simulated hosts (network namespaces) under `gradsync run` with torchrun's c10d rendezvous:
one host dies with all its processes, the other waits, the host comes back, and the job finishes
bitwise equal to a run that never stopped. Needs root (skipped otherwise)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from gradsync.bench.cluster import ClusterSpec, SimulatedCluster
from gradsync.distributed import free_port
from tests.checkpoint.hosts import launch_on_host, wait_for

pytestmark = pytest.mark.launches  # every test here starts processes


def _launcher(cluster: SimulatedCluster, host: int, port: int, tmp_path: Path, restarts: int):
    return launch_on_host(cluster, host, port, tmp_path, nnodes="2", restarts=restarts, rdzv_id="multihost-test",
                          script_args=("--step-delay", "0.2"))


@pytest.mark.timeout(240)
def test_a_host_dies_and_comes_back_and_the_job_ends_bitwise_equal(needs_cluster, tmp_path, uninterrupted):
    reference = uninterrupted["sha256"]
    port = free_port()
    with SimulatedCluster(ClusterSpec(hosts=2, link="1gbit")) as cluster:
        host0 = _launcher(cluster, 0, port, tmp_path, restarts=2)
        host1 = _launcher(cluster, 1, port, tmp_path, restarts=2)
        wait_for(lambda: (tmp_path / "ckpt" / "step-000000003" / "manifest.json").exists(), 90, "the first checkpoint")
        cluster.kill_host(1)  # the host dies: its launcher and its worker at once
        host1.wait()
        assert not (tmp_path / "ckpt" / "step-000000015" / "manifest.json").exists(), "killed too late to test anything"
        time.sleep(2)
        assert host0.poll() is None, "the surviving host gave up instead of waiting for its peer"
        host1 = _launcher(cluster, 1, port, tmp_path, restarts=2)  # the host comes back
        host1.wait(timeout=150)
        host0.wait(timeout=30)
        logs = "".join(p.read_text() for p in sorted(tmp_path.glob("host*.log")))
        assert (host0.returncode, host1.returncode) == (0, 0), logs
    shas = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text())["sha256"] for r in range(2)]
    assert shas == [reference] * 2, logs
    assert "resuming from" in logs
    # The host that stayed names the one that went: its rank went silent, its node said nothing.
    (cause,) = [f for f in json.loads((tmp_path / "run-host0" / "workers" / "attempt0" / "diagnosis.json").read_text())["findings"]
                if f["severity"] == "error"]
    assert (cause["category"], cause["ranks"]) == ("rank_unreachable", [1]), cause
