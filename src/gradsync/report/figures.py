"""The report's pictures, one matplotlib figure each, drawn from a run's records as PNG bytes.

Each function returns None when the run holds nothing for it, so a report shows what the run
recorded and no empty axes.
"""

from __future__ import annotations

import io
import statistics
from typing import Any

from gradsync.extras import require
from gradsync.report import timeline
from gradsync.report.collect import RunRecords
from gradsync.rundir.records import METRICS_KEYS

STEP_AXIS = "optimizer step"  # the x axis of every plot over time (seconds only where a run never stepped)

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
    loss.set(title="training loss", xlabel=STEP_AXIS, ylabel="loss")
    throughput.plot(steps, [row["samples_per_s"] for row in rows], color="tab:green")
    throughput.set(title="throughput (all ranks)", xlabel=STEP_AXIS, ylabel="samples / s")
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
        axes.set(title="profiled steps, mean per rank", ylabel="ms per step")
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
    """Per-rank busy time and utilisation over the gather intervals: a slow or starved rank stands out.

    Both on fixed scales, so noise stays pale and a real difference does not: busy time as a
    share of the run's median step (0-100%), utilisation 0-100%.
    """
    intervals = records.intervals
    if not intervals:
        return None
    median_step = statistics.median(row["step_time_s"] for row in records.rows)
    ranks = sorted({int(r) for row in intervals for r in row["rank_busy_s"]})
    busy = [[100 * row["rank_busy_s"].get(str(r), float("nan")) / median_step for row in intervals] for r in ranks]
    utilisation_key = "gpu_util_percent" if any(
        "gpu_util_percent" in values for row in intervals for values in row.get("system", {}).values()
    ) else "cpu_percent"
    utilisation = [
        [row.get("system", {}).get(str(r), {}).get(utilisation_key, float("nan")) for row in intervals] for r in ranks
    ]
    plt = _pyplot()
    figure, axes = plt.subplots(1, 2, figsize=(11, 1.4 + 0.45 * len(ranks)), squeeze=False)
    steps = [row["step"] for row in intervals]
    titles = (f"busy time, % of the median step ({1e3 * median_step:.1f} ms)", f"{utilisation_key.replace('_', ' ')} (%)")
    for axis, values, title, colours in zip(axes[0], (busy, utilisation), titles, ("magma", "viridis")):
        _heat_map(figure, axis, values, title, colours, ranks, steps, "interval ending at optimizer step")
    return _png(figure)


def _heat_map(figure: Any, axis: Any, values: list[list[float]], title: str, colours: str, ranks: list[int],
              ends: list[int], xlabel: str) -> Any:
    """Ranks down, intervals across, on the fixed 0-100 scale (above 100: the scale's top colour)."""
    image = axis.imshow(values, aspect="auto", cmap=colours, interpolation="nearest", vmin=0, vmax=100)
    axis.set(title=title, xlabel=xlabel, yticks=range(len(ranks)), yticklabels=[f"rank {r}" for r in ranks])
    ticks = list(range(0, len(ends), max(1, -(-len(ends) // 6))))  # at most 6 labels
    axis.set_xticks(ticks, [str(ends[i]) for i in ticks])
    figure.colorbar(image, ax=axis, extend="max")
    return image


def exposed_communication(records: RunRecords) -> bytes | None:
    """The share of each step spent waiting for gradient communication, over the run."""
    rows = records.rows
    if not rows or not any(row.get("exposed_comm_share") for row in rows):
        return None
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(11, 3))
    axes.plot([row["step"] for row in rows], [100 * row["exposed_comm_share"] for row in rows], color="tab:red")
    axes.set(title="exposed communication", xlabel=STEP_AXIS, ylabel="% of the step", ylim=(0, None))
    return _png(figure)


def machines_over_time(records: RunRecords) -> bytes | None:
    """Each rank's utilisation and network rate over the run, as `gradsync run` logged them,
    placed at the step each reading was taken (seconds only for a run that never stepped)."""
    series = {rank: rows for rank, rows in sorted(records.system.items()) if rows}
    if not series:
        return None
    key = timeline.counter(series)
    start = min(rows[0]["time"] for rows in series.values())
    gpu = any("gpu_util_percent" in row for rows in series.values() for row in rows)
    utilisation_key = "gpu_util_percent" if gpu else "cpu_percent"
    plt = _pyplot()
    figure, (utilisation, network) = plt.subplots(1, 2, figsize=(11, 3.4))
    for rank, rows in series.items():
        x = timeline.step_at(rows, key) or [row["time"] - start for row in rows]
        utilisation.plot(x, [row.get(utilisation_key, float("nan")) for row in rows], label=f"rank {rank}")
        network.plot(x, [row.get("net_sent_mbps", float("nan")) for row in rows], label=f"rank {rank}")
    xlabel = STEP_AXIS if key == "optimizer_steps" else "backward pass" if key else "seconds since the first reading"
    utilisation.set(title=utilisation_key.replace("_", " "), xlabel=xlabel, ylabel="%")
    network.set(title="sent on the backend's interface", xlabel=xlabel, ylabel="Mbit/s")
    for axis in (utilisation, network):
        axis.legend(fontsize="small")
    return _png(figure)


def _per_rank_lines(found: timeline.Timeline, values: dict[int, list[float]], title: str, ylabel: str, top: float | None) -> bytes:
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(11, 3.2))
    for rank in found.ranks:
        axes.plot(found.ends, values[rank], marker=".", label=f"rank {rank}")
    axes.set(title=title, xlabel=f"interval ending at {found.unit}", ylabel=ylabel, ylim=(0, top))
    axes.legend(fontsize="small")
    return _png(figure)


def step_times(records: RunRecords) -> bytes | None:
    """How long a step took on each rank, interval by interval, from `gradsync run`'s readings."""
    found = records.recorded
    if found is None:
        return None
    milliseconds = {rank: [1e3 * t for t in times] for rank, times in found.step_time_s.items()}
    return _per_rank_lines(found, milliseconds, f"time per {found.unit}", "ms", None)


def communication_waits(records: RunRecords) -> bytes | None:
    """The share of each interval a rank spent waiting on communication (blocking collectives and
    the end-of-backward wait for gradient reductions)."""
    found = records.recorded
    if found is None:
        return None
    percent = {rank: [100 * w for w in waits] for rank, waits in found.wait_share.items()}
    return _per_rank_lines(found, percent, "waiting on communication (collectives, and backward's wait for gradient reductions)",
                           "% of the interval", 100)


def busy_by_rank(records: RunRecords) -> bytes | None:
    """Ranks down, intervals across: the share of time each rank worked (did not wait), 0-100%,
    with the slowest rank of each interval (the one that waited least) marked."""
    found = records.recorded
    if found is None or len(found.ranks) < 2:
        return None
    ranks = found.ranks
    busy = [[100 * (1 - w) for w in found.wait_share[rank]] for rank in ranks]
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(11, 1.6 + 0.45 * len(ranks)))
    _heat_map(figure, axes, busy, "working, not waiting (% of the interval); x: the slowest rank", "magma", ranks,
              found.ends, f"interval ending at {found.unit}")
    slowest = found.slowest_rank()
    axes.scatter(range(len(slowest)), [ranks.index(r) for r in slowest], marker="x", color="tab:cyan", s=30)
    return _png(figure)


def user_scalars(records: RunRecords) -> bytes | None:
    """What the script logged itself (`trainer.log(...)`: accuracy, eval loss, ...), one panel each."""
    keys = sorted({k for row in records.rows for k, v in row.items()
                   if k not in METRICS_KEYS and k != "loss" and isinstance(v, (int, float)) and not isinstance(v, bool)})
    if not keys:
        return None
    plt = _pyplot()
    columns = min(3, len(keys))
    lines = -(-len(keys) // columns)
    figure, axes = plt.subplots(lines, columns, figsize=(11, 3 * lines), squeeze=False)
    for axis, key in zip(axes.flat, keys):
        points = [(row["step"], row[key]) for row in records.rows if isinstance(row.get(key), (int, float))]
        axis.plot(*zip(*points), marker="." if len(points) < 30 else None, color="tab:blue")
        axis.set(title=key, xlabel=STEP_AXIS)
    for axis in list(axes.flat)[len(keys):]:
        axis.set_visible(False)
    return _png(figure)


LAST_SECONDS = 10.0  # how much of each rank's end the failure timeline shows


def last_collectives(records: RunRecords) -> bytes | None:
    """What each rank did in its last seconds: every recorded collective as a bar from entry to
    completion; one never completed runs to the end in red. Drawn for runs that did not end well."""
    lanes = records.collectives
    if not records.failed or not lanes:
        return None
    end = records.last_seen
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(11, 1.2 + 0.6 * len(lanes)))
    ranks = sorted(lanes)
    for lane, rank in enumerate(ranks):
        recent = [r for r in lanes[rank] if (r.get("finished") or end) >= end - LAST_SECONDS]
        for record in recent:
            start = max(record["entered"], end - LAST_SECONDS) - end
            done = record.get("finished")
            open_ended = done is None or record.get("state") == "failed"
            stop = (done if done is not None else end) - end
            axes.barh(lane, max(stop - start, 0.02), left=start, height=0.6,
                      color="tab:red" if open_ended else "tab:blue", edgecolor="black", linewidth=0.3)
        if recent:
            last = recent[-1]
            label = f"{last['op']} #{last['seq']}" if last.get("seq") is not None else last["op"]
            axes.annotate(label + (f" at {_short_site(last.get('site'))}" if last.get("site") else ""),
                          (0, lane), xytext=(4, 0), textcoords="offset points", va="center", fontsize="small")
    axes.set(title=f"each rank's collectives in its last {LAST_SECONDS:.0f} s (red: never completed)",
             xlabel="seconds before the last record", yticks=range(len(ranks)), yticklabels=[f"rank {r}" for r in ranks],
             xlim=(-LAST_SECONDS, max(1.0, LAST_SECONDS * 0.35)))
    axes.invert_yaxis()
    return _png(figure)


def _short_site(site: str | None) -> str:
    """file:line without the folders (the page quotes the full path where it matters)."""
    return (site or "").rsplit("/", 1)[-1]
