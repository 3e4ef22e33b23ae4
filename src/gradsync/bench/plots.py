"""The picture of a `gradsync bench train` report: throughput and where each step's time went."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_report(report: dict[str, Any], output_dir: str | Path) -> list[Path]:
    """report.json always; report.png when matplotlib is installed (it is optional)."""
    directory = Path(output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    written = [directory / "report.json"]
    written[0].write_text(json.dumps(report, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return written
    results = report["results"]
    names = [r["config"] for r in results]
    figure, (throughput, breakdown, losses) = plt.subplots(1, 3, figsize=(15, 4.5))
    figure.suptitle(f"{report['workload']}: {report['world_size']} workers, batch {report['batch_size_per_worker']} per worker")

    throughput.bar(names, [r["samples_per_s_per_worker"] for r in results], color="tab:blue")
    throughput.axhline(report["single_worker_samples_per_s"], color="black", linestyle="--", label="one worker alone")
    for index, r in enumerate(results):
        throughput.annotate(f"{r['scaling_efficiency']:.0%}", (index, r["samples_per_s_per_worker"]), ha="center", va="bottom")
    throughput.set_ylabel("samples/s per worker (label: scaling efficiency)")
    throughput.legend(loc="lower right")

    step_ms = [1e3 * report["batch_size_per_worker"] / r["samples_per_s_per_worker"] for r in results]
    exposed = [s * (r["exposed_comm_share"] or 0) for s, r in zip(step_ms, results)]
    breakdown.bar(names, [s - e for s, e in zip(step_ms, exposed)], label="compute and hidden communication", color="tab:green")
    breakdown.bar(names, exposed, bottom=[s - e for s, e in zip(step_ms, exposed)], label="exposed communication", color="tab:red")
    breakdown.set_ylabel("step time (ms)")
    breakdown.legend(loc="lower right")

    for r in results:
        curve = [(step, loss) for step, loss in r.get("loss_curve", []) if loss is not None]
        if curve:
            losses.plot(*zip(*curve), label=r["config"])
    losses.set_xlabel("optimizer step")
    losses.set_ylabel("training loss")
    losses.legend()

    figure.tight_layout()
    written.append(directory / "report.png")
    figure.savefig(written[-1], dpi=100)
    plt.close(figure)
    return written
