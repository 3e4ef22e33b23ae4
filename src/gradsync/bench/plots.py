"""The pictures of a `gradsync bench train` report: throughput, where each step's time went, the
loss curves, and the network's all-reduce bandwidth by message size; one self-contained HTML page."""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Any

from gradsync.extras import require


def pyplot() -> Any:
    """matplotlib's pyplot, drawing off-screen; MissingExtra naming `gradsync[report]` without it.

    `--output-dir` can call it before the benchmark runs, so a missing matplotlib costs no minutes
    of measurement."""
    matplotlib = require("matplotlib", "the benchmark's report.png and report.html are drawn")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_bench_report(report: dict[str, Any], output_dir: str | Path) -> list[Path]:
    """report.json, report.png and report.html (the table and the picture in one file).

    report.json is written first: without matplotlib the measurements are kept and MissingExtra says
    which extra draws the rest."""
    directory = Path(output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    written = [directory / "report.json"]
    written[0].write_text(json.dumps(report, indent=2))
    plt = pyplot()

    results = report["results"]
    names = [r["config"] for r in results]
    figure, (throughput, breakdown, losses, bandwidth) = plt.subplots(1, 4, figsize=(20, 4.5))
    figure.suptitle(f"{report['workload']}: {report['world_size']} workers, batch {report['batch_size_per_worker']} per worker")

    spreads = [r.get("rounds") or [] for r in results]
    errors = [[r["samples_per_s_per_worker"] - min((x["samples_per_s_per_worker"] for x in rounds), default=r["samples_per_s_per_worker"]) for r, rounds in zip(results, spreads)],
              [max((x["samples_per_s_per_worker"] for x in rounds), default=r["samples_per_s_per_worker"]) - r["samples_per_s_per_worker"] for r, rounds in zip(results, spreads)]]
    throughput.bar(names, [r["samples_per_s_per_worker"] for r in results], color="tab:blue", yerr=errors, capsize=3)
    throughput.axhline(report["single_worker_samples_per_s"], color="black", linestyle="--", label="one worker alone")
    for index, r in enumerate(results):
        throughput.annotate(f"{r['scaling_efficiency']:.0%}", (index, r["samples_per_s_per_worker"]), ha="center", va="bottom")
    throughput.set_ylabel("samples/s per worker (label: scaling efficiency)")
    throughput.legend(loc="lower right")

    step_ms = [1e3 * report["batch_size_per_worker"] / r["samples_per_s_per_worker"] for r in results]
    exposed = [s * (r["exposed_comm_share"] or 0) for s, r in zip(step_ms, results)]
    metered = [r["exposed_comm_share"] is not None for r in results]
    breakdown.bar(names, [s - e for s, e in zip(step_ms, exposed)], label="compute and hidden communication",
                  color=["tab:green" if m else "tab:gray" for m in metered])
    breakdown.bar(names, exposed, bottom=[s - e for s, e in zip(step_ms, exposed)], label="exposed communication", color="tab:red")
    if not all(metered):  # a peer's bare loop is not metered: its step is one grey bar
        breakdown.bar([], [], color="tab:gray", label="step (a peer: not metered)")
    breakdown.set_ylabel("step time (ms)")
    breakdown.legend(loc="lower right")

    for r in results:
        curve = [(step, loss) for step, loss in r.get("loss_curve", []) if loss is not None]
        if curve:
            losses.plot(*zip(*curve), label=r["config"])
    losses.set_xlabel("optimizer step")
    losses.set_ylabel("training loss")
    losses.legend()

    sweep = report.get("allreduce") or []
    if sweep:
        bandwidth.plot([r["bytes"] for r in sweep], [r["busbw_gbps"] * 8 for r in sweep], marker="o")
        bandwidth.set_xscale("log", base=2)
    bandwidth.set_xlabel("all-reduce message size (bytes)")
    bandwidth.set_ylabel("bus bandwidth (Gbit/s)")

    figure.tight_layout()
    picture = io.BytesIO()
    figure.savefig(picture, format="png", dpi=100)
    plt.close(figure)
    written.append(directory / "report.png")
    written[-1].write_bytes(picture.getvalue())
    written.append(directory / "report.html")
    written[-1].write_text(_html(report, picture.getvalue()))
    return written


def _html(report: dict[str, Any], png: bytes) -> str:
    from gradsync.bench.train import render

    title = html.escape(f"gradsync bench train: {report['workload']}, {report['world_size']} workers")
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title></head><body>"
        f"<h1>{title}</h1><pre>{html.escape(render(report))}</pre>"
        f"<img alt='throughput, step time, loss and bandwidth' src='data:image/png;base64,{base64.b64encode(png).decode()}'>"
        "</body></html>"
    )
