"""compression='auto' on two simulated hosts: exact gradients on a fast link, compression on a slow one.

Both runs allow auto to raise accumulation (up to 4 micro-batches per step); it may only do so
when communication still leaves 10% of the step exposed after compression.
"""

import json

import pytest

from gradsync.bench import cluster
from gradsync.distributed import free_port


MAX_ACCUMULATION = 4

# Beside other tests, the link's collectives starve for CPU: fp32 once left 16% of its step
# exposed on the 10 Gbit/s link, and auto rightly compressed. These need the machine to themselves.
pytestmark = pytest.mark.alone


def _auto_choice(link, tmp_path):
    spec = cluster.ClusterSpec(hosts=2, link=link)
    reason = cluster.available(spec)
    if reason is not None:
        pytest.skip(reason)
    tmp_path.mkdir(parents=True, exist_ok=True)
    result = tmp_path / "choice.json"
    with cluster.SimulatedCluster(spec) as hosts:
        code = cluster.run_torchrun(
            hosts, 1,
            ["tests.comm.auto_worker", "--result", str(result), "--run-dir", str(tmp_path / "run"),
             "--max-accumulation", str(MAX_ACCUMULATION)],
            free_port(),
        )
    assert code == 0
    choice = json.loads(result.read_text())
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    choice["samples_per_step"] = [row["samples"] for row in rows if "reductions" in row]
    return choice


def test_auto_keeps_exact_gradients_on_a_fast_link(tmp_path):
    # The trials' step times on this 2-core machine swing by 10-20% (CI once saw bf16 11% and, in a
    # second tuning, powersgd 12% "faster" than fp32 on this link); the exposed-communication bound
    # must keep fp32 regardless.
    choice = _auto_choice("10gbit", tmp_path)
    assert choice["compression"] == "none", choice
    assert choice["baseline_exposed_comm_s"] < 0.1 * choice["step_time_s"]["none"], choice
    # Allowed to grow the batch, auto still leaves it alone: nothing is exposed to hide.
    assert choice["accumulation_steps"] == 1 and set(choice["samples_per_step"]) == {2 * 16}, choice


def test_auto_compresses_on_a_slow_link(tmp_path):
    choice = _auto_choice("20mbit", tmp_path)
    assert choice["compression"] != "none", choice
    times = choice["step_time_s"]
    assert times[choice["compression"]] < 0.95 * times["none"]
    assert choice["baseline_exposed_comm_s"] > 0.1 * times["none"], choice
    # Accumulation grows only if the compressor left 10% of its step exposed, and then it shows
    # in the steps after the decision (an epoch of 40 batches, decided after 30).
    left = choice["exposed_comm_s"][choice["compression"]] / times[choice["compression"]]
    k = choice["accumulation_steps"]
    assert (k > 1) == (left >= 0.1), choice
    # Steps after the decision hold k micro-batches, except the epoch's last, which takes what is
    # left when k does not divide the remaining batches (10 = 3 + 3 + 3 + 1): none holds more.
    samples = choice["samples_per_step"]
    assert max(samples) == 2 * 16 * k and samples[-1] <= 2 * 16 * k, choice
