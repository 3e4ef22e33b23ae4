"""train_script.py under `gradsync run` on simulated hosts with c10d rendezvous, for the tests of
jobs that lose, regain or gain a host (test_multihost, test_elastic)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from gradsync.bench.cluster import SimulatedCluster
from tests.harness import REPO_ROOT


def launch_on_host(cluster: SimulatedCluster, host: int, port: int, tmp_path: Path, *, nnodes: str, restarts: int,
                   rdzv_id: str, rdzv_conf: str = "", script_args: tuple[str, ...] = ()) -> subprocess.Popen:
    """One host's launcher; its console goes to tmp_path/host<N>-<time>.log (a host started
    again gets a log of its own)."""
    addresses = [h.address for h in cluster.hosts]
    conf = f"is_host={'true' if host == 0 else 'false'}" + (f",{rdzv_conf}" if rdzv_conf else "")
    argv = [
        sys.executable, "-m", "gradsync", "run",
        "--nnodes", nnodes, "--nproc-per-node", "1", "--max-restarts", str(restarts),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{addresses[0]}:{port}", "--rdzv-id", rdzv_id,
        # Hostnames do not resolve inside a namespace: each host names its own address, and
        # host 0 serves the rendezvous store (see ../shared/README.md).
        "--local-addr", addresses[host], "--rdzv-conf", conf,
        "--run-dir", str(tmp_path / f"run-host{host}"), "--stall-timeout", "20",
        "tests/checkpoint/train_script.py", "--checkpoint-dir", str(tmp_path / "ckpt"),
        "--out", str(tmp_path / "out"), *script_args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    with open(tmp_path / f"host{host}-{time.monotonic_ns()}.log", "w") as log:
        return cluster.run(host, argv, env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)
