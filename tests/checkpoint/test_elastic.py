"""An elastic job as users run it: `gradsync run --nnodes 1:2` with c10d rendezvous on two
simulated hosts (network namespaces; needs root, skipped otherwise).

One host dies for good: the other goes on alone after a restart, resuming onto the smaller
world size. Then the host comes back and is taken in at the next restart (torchrun's agent
stops the healthy worker for it; the trainer saves on that SIGTERM). Across the three groups of
workers (2, 1, then 2 ranks), every sample of every epoch is trained on exactly once.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest

from gradsync.bench.cluster import ClusterSpec, SimulatedCluster
from gradsync.distributed import free_port
from tests.checkpoint.train_script import SAMPLES
from tests.checkpoint.hosts import launch_on_host, wait_for
from tests.timed_findings import untimed

pytestmark = pytest.mark.launches  # every test here starts processes

EPOCHS = 10
# Quick rendezvous decisions: a lone node starts 2 s after the last call, a dead node's
# heartbeat is missed after 3 s.
RDZV_CONF = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"


def _launcher(cluster: SimulatedCluster, host: int, port: int, tmp_path: Path):
    return launch_on_host(
        cluster, host, port, tmp_path, nnodes="1:2", restarts=3, rdzv_id="elastic-test", rdzv_conf=RDZV_CONF,
        script_args=("--epochs", str(EPOCHS), "--constant-lr", "--step-delay", "0.15", "--seen-log", str(tmp_path / "seen")),
    )


def _saved_by(world_size: int, checkpoints: Path) -> bool:
    for manifest in checkpoints.glob("step-*/manifest.json"):
        try:
            if json.loads(manifest.read_text())["world_size"] == world_size:
                return True
        except (OSError, ValueError):
            pass  # being written
    return False


def _samples_per_epoch(seen: Path, resumed_from: list[int]) -> dict[int, Counter]:
    """What each epoch trained on, across the groups of workers: a group's batches count up to
    the step the next group resumed from (later ones were replayed); the last group's all count.
    Each worker logged its batches with their optimizer step; a group starts after the step it
    resumed from, which tells which group a worker belonged to."""
    starts, ends = [0, *resumed_from], [*resumed_from, float("inf")]
    epochs: dict[int, Counter] = {}
    for path in seen.glob("*.jsonl"):
        batches = [json.loads(line) for line in path.read_text().splitlines()]
        group = max(g for g, start in enumerate(starts) if batches[0]["step"] > start)
        for batch in batches:
            if batch["step"] <= ends[group]:
                epochs.setdefault(batch["epoch"], Counter()).update(batch["indices"])
    return epochs


@pytest.mark.timeout(300)
def test_a_host_leaves_for_good_then_another_joins_and_every_sample_is_seen_once(needs_cluster, tmp_path):
    (tmp_path / "seen").mkdir()
    port = free_port()
    with SimulatedCluster(ClusterSpec(hosts=2, link="1gbit")) as cluster:
        host0 = _launcher(cluster, 0, port, tmp_path)
        host1 = _launcher(cluster, 1, port, tmp_path)
        wait_for(lambda: (tmp_path / "ckpt" / "step-000000003" / "manifest.json").exists(), 90, "the first checkpoint")
        cluster.kill_host(1)  # for good: nothing restarts it
        host1.wait()
        wait_for(lambda: _saved_by(1, tmp_path / "ckpt"), 120, "host 0 to go on alone and save")
        host1 = _launcher(cluster, 1, port, tmp_path)  # a host joins the running job
        host0.wait(timeout=200)
        host1.wait(timeout=60)
        logs = "".join(p.read_text() for p in sorted(tmp_path.glob("host0-*.log")))
        assert (host0.returncode, host1.returncode) == (0, 0), logs

    resumed = [int(step) for step in re.findall(r"resuming from \S+ \(step (\d+)\)", logs)]
    assert len(resumed) == 2 and resumed[0] < resumed[1], logs
    assert "this run has 1" in logs and "this run has 2" in logs  # 2 -> 1 rank, then 1 -> 2
    epochs = _samples_per_epoch(tmp_path / "seen", resumed)
    assert sorted(epochs) == list(range(EPOCHS))
    for epoch, samples in epochs.items():
        assert samples == Counter(range(SAMPLES)), f"epoch {epoch}: {sorted((samples - Counter(range(SAMPLES))).items())} extra, {sorted((Counter(range(SAMPLES)) - samples).items())} missing"
    results = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in range(2)]
    assert results[0]["sha256"] == results[1]["sha256"]  # the last group ended as replicas

    diagnosis = json.loads((tmp_path / "run-host0" / "diagnosis.json").read_text())
    assert diagnosis["status"] == "ok", diagnosis
    assert [a["status"] for a in diagnosis["attempts"]] == ["failed", "regrouped", "ok"], diagnosis["attempts"]
    categories = [f["category"] for f in untimed(diagnosis["findings"])]
    assert categories == ["restarted", "regrouped"], diagnosis["findings"]
    assert "the job's nodes changed (a node joined): restarting the workers as attempt 2" in logs
