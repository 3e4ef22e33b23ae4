"""Per-step metrics: averaged across ranks, slowest rank named, written as JSON lines and TensorBoard."""

import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import gradsync
from gradsync.metrics.recorder import aggregate
from tests.harness import launch

REQUIRED = {
    "step", "epoch", "loss", "samples", "samples_per_s", "step_time_s", "step_time_max_s",
    "slowest_rank", "slowest_rank_busy_s", "exposed_comm_s", "exposed_comm_share", "reductions", "skipped", "lr",
}


def test_aggregate_averages_values_and_names_the_slowest_rank():
    base = {"step": 3, "epoch": 0, "reductions": 1, "skipped": None, "grad_norm": None, "lr": 0.1}
    row = aggregate([
        {**base, "samples": 8, "step_time_s": 0.2, "exposed_comm_s": 0.02, "values": {"loss": 1.0}},
        {**base, "samples": 8, "step_time_s": 0.4, "exposed_comm_s": 0.06, "values": {"loss": 3.0, "only1": 5.0}},
    ])
    assert row["loss"] == 2.0 and row["only1"] == 5.0
    assert row["slowest_rank"] == 1 and row["step_time_max_s"] == 0.4
    assert row["slowest_rank_busy_s"] == 0.4 - 0.06
    assert row["samples"] == 16 and row["samples_per_s"] == 16 / 0.4
    assert abs(row["exposed_comm_share"] - 0.04 / 0.3) < 1e-12


def test_the_slowest_rank_is_the_busiest_not_the_one_that_waited_longest():
    # Rank 0 finished its compute early and waited in the all-reduce for rank 1.
    base = {"step": 1, "epoch": 0, "samples": 8, "reductions": 1, "skipped": None, "grad_norm": None, "lr": 0.1, "values": {}}
    row = aggregate([
        {**base, "step_time_s": 0.41, "exposed_comm_s": 0.30},
        {**base, "step_time_s": 0.40, "exposed_comm_s": 0.01},
    ])
    assert row["slowest_rank"] == 1 and abs(row["slowest_rank_busy_s"] - 0.39) < 1e-12


def _train_with_metrics(sleep_s):
    trainer = gradsync.setup(accumulation_steps=2, metrics={"log_every": 4, "system_every_s": 0.05})
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(48 * trainer.world_size, 32, generator=g), torch.randn(48 * trainer.world_size, 1, generator=g))
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    model, optimizer, loader = trainer.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01), data, batch_size=4)
    slow = trainer.rank == trainer.world_size - 1
    for _ in trainer.epochs(2):
        for x, y in loader:
            with trainer.step() as step:
                if slow:
                    time.sleep(sleep_s)
                step.backward(F.mse_loss(model(x), y))
            trainer.log(loss=float(trainer.rank))
        trainer.log({"eval/score": 1.0 + trainer.rank})
    summary = trainer.summary()
    trainer.close()
    result = {"summary": summary}
    if trainer.is_main:
        run_dir = Path(trainer.run_dir)
        result["rows"] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(run_dir / "tensorboard"))
        events.Reload()
        result["tags"] = events.Tags()["scalars"]
    return result


def test_metrics_rows_per_optimizer_step_across_ranks(world_size):
    sleep_s = 0.03
    results = launch(_train_with_metrics, world_size, sleep_s=sleep_s)
    rows = results[0]["rows"]
    assert len(rows) == 2 * 6, "one row per optimizer step: 12 batches per epoch, 2 per step, 2 epochs"
    for row in rows:
        assert REQUIRED <= row.keys()
        assert row["loss"] == (world_size - 1) / 2, "loss is averaged across ranks"
        assert row["samples"] == 2 * 4 * world_size
        assert row["samples_per_s"] > 0 and row["skipped"] is None
        assert row["step_time_max_s"] >= 2 * sleep_s
        assert row["slowest_rank_busy_s"] >= 2 * sleep_s
    assert [row["eval/score"] for row in rows if "eval/score" in row] == [1.0 + (world_size - 1) / 2] * 2
    slowest = [row["slowest_rank"] for row in rows]
    assert slowest.count(world_size - 1) >= 0.8 * len(rows), slowest
    if world_size > 1:
        assert all(row["reductions"] == 1 for row in rows)
        assert sum(row["exposed_comm_s"] for row in rows) > 0, "gradient all-reduce is never fully hidden here"
    else:
        assert all(row["reductions"] == 0 and row["exposed_comm_s"] == 0 for row in rows)
    summaries = [r["summary"] for r in results]
    assert all(s == summaries[0] for s in summaries), "the summary is identical on every rank"
    assert summaries[0]["steps"] == len(rows) and summaries[0]["loss"] == rows[-1]["loss"]
    assert {"train/loss", "train/samples_per_s", "train/step_time_max_s", "comm/exposed_share", "eval/score"} <= set(results[0]["tags"])
    _assert_interval_summaries(rows, results[0]["tags"], world_size, sleep_s)


def _assert_interval_summaries(rows, tags, world_size, sleep_s):
    """Each gather (every 4 steps) closes an interval: every rank's system metrics, the imbalance."""
    closing = [row for row in rows if "busy_spread_s" in row]
    assert [row["step"] for row in closing] == [4, 8, 12]
    for row in closing:
        assert set(row["system"]) == set(row["rank_busy_s"]) == {str(r) for r in range(world_size)}, row.get("system")
        for values in row["system"].values():
            assert values["rss_mb"] > 50 and values["cpu_percent"] >= 0
            assert values["net_sent_mbps"] >= 0 and values["net_recv_mbps"] >= 0
    if world_size > 1:
        # The last rank sleeps 2 x sleep_s per step outside communication: the others wait for it.
        assert [row["interval_slowest_rank"] for row in closing].count(world_size - 1) >= 2
        assert max(row["busy_spread_s"] for row in closing) > sleep_s
        # Gloo talks over loopback here, the interface the master address is reached through.
        assert max(v["net_sent_mbps"] for row in closing for v in row["system"].values()) > 0
    assert {"system/busy_spread_s", "system/rank0/cpu_percent", f"system/rank{world_size - 1}/rss_mb"} <= set(tags)
