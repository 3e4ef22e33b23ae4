"""The report's pictures, one matplotlib figure each, drawn from a run's records as PNG bytes.

Each function returns None when the run holds nothing for it, so a report shows what the run
recorded and no empty axes.
"""

from __future__ import annotations

import io
from typing import Any

from gradsync.extras import require
from gradsync.report.collect import RunRecords

# The breakdown's parts in the order a step runs them, and their colours across every figure.
BREAKDOWN_PARTS = (
    ("data_s", "data loading", "tab:purple"),
    ("forward_s", "forward", "tab:blue"),
    ("backward_s", "backward", "tab:green"),
    ("exposed_comm_s", "exposed communication", "tab:red"),
    ("optimizer_s", "optimizer", "tab:orange"),
    ("other_s", "other / idle", "tab:gray"),
)


def _pyplot():
    matplotlib = require("matplotlib", "the report draws its figures")
    matplotlib.use("Agg")  # no display: the report is written by servers and tests
    import matplotlib.pyplot as plt

    return plt


def _png(figure: Any) -> bytes:
    buffer = io.BytesIO()
    figure.tight_layout()
    figure.savefig(buffer, format="png", dpi=90)
    _pyplot().close(figure)
    return buffer.getvalue()


def training_curves(records: RunRecords) -> bytes | None:
    """Loss and throughput per optimizer step."""
    rows = records.rows
    if not rows:
        return None
    plt = _pyplot()
    figure, (loss, throughput) = plt.subplots(1, 2, figsize=(11, 3.6))
    steps = [row["step"] for row in rows]
    if any("loss" in row for row in rows):
        loss.plot([r["step"] for r in rows if "loss" in r], [r["loss"] for r in rows if "loss" in r], color="tab:blue")
    loss.set(title="training loss", xlabel="optimizer step", ylabel="loss")
    throughput.plot(steps, [row["samples_per_s"] for row in rows], color="tab:green")
    throughput.set(title="throughput (all ranks)", xlabel="optimizer step", ylabel="samples / s")
    return _png(figure)


def step_breakdown(records: RunRecords) -> bytes | None:
    """Where a step's time goes, per rank: from the profiler when it ran, else from the metrics."""
    plt = _pyplot()
    if records.breakdowns:
        ranks = sorted(records.breakdowns)
        means = [records.breakdowns[rank]["mean"] for rank in ranks]
        figure, axes = plt.subplots(figsize=(9, 3.6))
        bottoms = [0.0] * len(ranks)
        for key, label, colour in BREAKDOWN_PARTS:
            heights = [1e3 * mean.get(key, 0.0) for mean in means]
            axes.bar([f"rank {r}" for r in ranks], heights, bottom=bottoms, label=label, color=colour)
            bottoms = [b + h for b, h in zip(bottoms, heights)]
        overlap = ", ".join(f"rank {r}: {m.get('overlap_ratio') or 0:.0%}" for r, m in zip(ranks, means))
        axes.set(title=f"profiled steps; communication hidden behind backward: {overlap}", ylabel="ms per step")
        axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1, 1))
        return _png(figure)
    if not records.rows:
        return None
    rows = records.rows
    step_ms = sum(row["step_time_s"] for row in rows) / len(rows) * 1e3
    exposed_ms = sum(row["exposed_comm_s"] for row in rows) / len(rows) * 1e3
    figure, axes = plt.subplots(figsize=(7, 3.6))
    axes.bar(["mean step"], [step_ms - exposed_ms], color="tab:green", label="compute, data and hidden communication")
    axes.bar(["mean step"], [exposed_ms], bottom=[step_ms - exposed_ms], color="tab:red", label="exposed communication")
    axes.set(title="step time (run with --profile-steps A:B for the full breakdown)", ylabel="ms per step")
    axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1, 1))
    return _png(figure)


def rank_heat_maps(records: RunRecords) -> bytes | None:
    """Per-rank busy time and utilisation over the gather intervals: a slow or starved rank stands out."""
    intervals = records.intervals
    if not intervals:
        return None
    ranks = sorted({int(r) for row in intervals for r in row["rank_busy_s"]})
    busy = [[1e3 * row["rank_busy_s"].get(str(r), float("nan")) for row in intervals] for r in ranks]
    utilisation_key = "gpu_util_percent" if any(
        "gpu_util_percent" in values for row in intervals for values in row.get("system", {}).values()
    ) else "cpu_percent"
    utilisation = [
        [row.get("system", {}).get(str(r), {}).get(utilisation_key, float("nan")) for row in intervals] for r in ranks
    ]
    plt = _pyplot()
    figure, axes = plt.subplots(1, 2, figsize=(11, 1.2 + 0.45 * len(ranks)), squeeze=False)
    steps = [row["step"] for row in intervals]
    titles = ("busy time per step (ms)", f"{utilisation_key.replace('_', ' ')}")
    for axis, values, title, colours in zip(axes[0], (busy, utilisation), titles, ("magma", "viridis")):
        image = axis.imshow(values, aspect="auto", cmap=colours, interpolation="nearest")
        axis.set(title=title, xlabel="interval ending at step", yticks=range(len(ranks)), yticklabels=[f"rank {r}" for r in ranks])
        ticks = list(range(0, len(steps), max(1, -(-len(steps) // 6))))  # at most 6 labels
        axis.set_xticks(ticks, [str(steps[i]) for i in ticks])
        figure.colorbar(image, ax=axis)
    return _png(figure)


def exposed_communication(records: RunRecords) -> bytes | None:
    """The share of each step spent waiting for gradient communication, over the run."""
    rows = records.rows
    if not rows or not any(row.get("exposed_comm_share") for row in rows):
        return None
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(11, 3))
    axes.plot([row["step"] for row in rows], [100 * row["exposed_comm_share"] for row in rows], color="tab:red")
    axes.set(title="exposed communication", xlabel="optimizer step", ylabel="% of the step", ylim=(0, None))
    return _png(figure)


def machines_over_time(records: RunRecords) -> bytes | None:
    """Each rank's utilisation and network rate over the run, as `gradsync run` logged them."""
    series = {rank: rows for rank, rows in sorted(records.system.items()) if rows}
    if not series:
        return None
    start = min(rows[0]["time"] for rows in series.values())
    gpu = any("gpu_util_percent" in row for rows in series.values() for row in rows)
    utilisation_key = "gpu_util_percent" if gpu else "cpu_percent"
    plt = _pyplot()
    figure, (utilisation, network) = plt.subplots(1, 2, figsize=(11, 3.4))
    for rank, rows in series.items():
        seconds = [row["time"] - start for row in rows]
        utilisation.plot(seconds, [row.get(utilisation_key, float("nan")) for row in rows], label=f"rank {rank}")
        network.plot(seconds, [row.get("net_sent_mbps", float("nan")) for row in rows], label=f"rank {rank}")
    utilisation.set(title=utilisation_key.replace("_", " "), xlabel="seconds", ylabel="%")
    network.set(title="sent on the backend's interface", xlabel="seconds", ylabel="Mbit/s")
    for axis in (utilisation, network):
        axis.legend(fontsize="small")
    return _png(figure)
