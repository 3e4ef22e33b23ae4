"""compression='auto' on two simulated hosts: exact gradients on a fast link, compression on a slow one."""

import json

import pytest

from gradsync.bench import cluster
from gradsync.distributed import free_port


def _auto_choice(link, tmp_path):
    spec = cluster.ClusterSpec(hosts=2, link=link)
    reason = cluster.available(spec)
    if reason is not None:
        pytest.skip(reason)
    tmp_path.mkdir(parents=True, exist_ok=True)
    result = tmp_path / "choice.json"
    with cluster.SimulatedCluster(spec) as hosts:
        code = cluster.run_torchrun(
            hosts, 1, ["tests.comm.auto_worker", "--result", str(result), "--run-dir", str(tmp_path / "run")], free_port()
        )
    assert code == 0
    return json.loads(result.read_text())


def test_auto_keeps_exact_gradients_on_a_fast_link(tmp_path):
    # The trials' step times on this 2-core machine swing by 10-20% (CI once saw bf16 11% and, in a
    # second tuning, powersgd 12% "faster" than fp32 on this link); the exposed-communication bound
    # must keep fp32 regardless.
    choice = _auto_choice("10gbit", tmp_path)
    assert choice["compression"] == "none", choice
    assert choice["baseline_exposed_comm_s"] < 0.1 * choice["step_time_s"]["none"], choice


def test_auto_compresses_on_a_slow_link(tmp_path):
    choice = _auto_choice("20mbit", tmp_path)
    assert choice["compression"] != "none", choice
    times = choice["step_time_s"]
    assert times[choice["compression"]] < 0.95 * times["none"]
    assert choice["baseline_exposed_comm_s"] > 0.1 * times["none"], choice
