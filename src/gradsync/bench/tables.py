"""The docs' tables of a `bench train` report, written into a Markdown file between two markers:
gradsync's configurations beside the PyTorch peer doing the same thing, with the ceiling
(`--kind peers`), or the parallel strategies side by side (`--kind strategies`).

A table in the docs goes stale the moment the code changes, and one copied by hand from a log
drifts from the run it claims to come from. So the docs hold the table a make target wrote from
one report, with the command that produced it (date-free, so rerunning it changes only the
numbers):

    python -m gradsync.bench.tables REPORT.json DOC.md --marker NAME --command "make bench-..." [--kind strategies]

replaces what lies between `<!-- NAME -->` and `<!-- /NAME -->` in DOC.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from gradsync.errors import ConfigError

# gradsync's configuration -> the peer that does the same thing without gradsync.
PEER_OF = {"fp32": "plain", "fp16": "torch-fp16", "bf16": "torch-bf16", "powersgd": "torch-powersgd"}
# The peers that are ceilings, not PyTorch's way of doing what a gradsync configuration does
# (gradsync.bench.peers): each gets a sentence above the table, not a row in it.
CEILINGS = {
    "no-comm": ("**Ceiling** (`no-comm`: the same workers training side by side, never communicating): {}. "
                "No communication setting can beat it on this machine."),
    "lockstep": ("**Ceiling of synchronous training** (`lockstep`: the same workers waiting for each other once a step, "
                 "sending nothing else): {}. DDP cannot beat it by more than the run's noise: each of its steps lasts "
                 "as long as the slowest worker's."),
}


def _ceiling(config: str, row: dict[str, Any]) -> str:
    """A ceiling's sentence; lockstep's says how much of a step its workers waited for each other."""
    sentence = CEILINGS[config].format(_efficiency(row))
    if row.get("exposed_comm_share") is not None:
        sentence += f" Its workers waited {row['exposed_comm_share']:.0%} of each step for each other."
    return sentence


def _efficiency(row: dict[str, Any] | None) -> str:
    if row is None:
        return ""
    rounds = row.get("rounds")
    if rounds is not None and len(rounds) < 2:
        return f"{row['scaling_efficiency']:.0%}"  # one round has no range
    low, high = row.get("scaling_efficiency_spread") or (row["scaling_efficiency"],) * 2
    return f"{row['scaling_efficiency']:.0%} ({100 * low:.0f}–{100 * high:.0f})"


def _faults(row: dict[str, Any] | None) -> str:
    """Page faults per timed step, worst worker: a job that gives freed memory back and faults it
    in again every step pays for it in time the efficiency shows but does not explain."""
    if row is None:
        return ""
    faults = row.get("page_faults_per_step")
    return "—" if faults is None else f"{faults:,.0f}"


def _exposed(row: dict[str, Any]) -> str:
    return "—" if row.get("exposed_comm_share") is None else f"{row['exposed_comm_share']:.0%}"


def _heading(report: dict[str, Any], command: str) -> list[str]:
    """Every table's first lines: the command, then the workers, the rounds and the lone worker."""
    runs = report.get("single_worker_runs") or [report["single_worker_samples_per_s"]]
    rounds = report.get("rounds", 1)
    return [
        "```",
        command,
        "```",
        "",
        f"{report['world_size']} workers, batch {report['batch_size_per_worker']} per worker, "
        + (f"{rounds} interleaved rounds (median, and the rounds' range)" if rounds > 1
           else "one round: a single figure each, so differences of a few points are within the noise")
        + f". One worker alone: {report['single_worker_samples_per_s']:.1f} samples/s "
        f"({', '.join(f'{r:.1f}' for r in runs)} around the rounds).",
    ]


def peer_table(report: dict[str, Any], command: str) -> str:
    """The Markdown block: the command, the lone worker, the ceiling, then one row per gradsync
    configuration with its peer beside it (peers without a gradsync twin get a row of their own)."""
    rows = {r["config"]: r for r in report["results"]}
    lines = _heading(report, command)
    for ceiling in CEILINGS:
        if ceiling in rows:
            lines += ["", _ceiling(ceiling, rows[ceiling])]
    setting = report.get("host_memory", "release")
    if report.get("peers_host_memory"):
        lines += ["", f"Every job, the peers included, ran with `host_memory={setting!r}`: "
                      + ("the C library's defaults." if setting == "release" else
                         "on CPU, freed host memory kept for the next step (gradsync's jobs set it up, the peers got "
                         "it from their environment, GLIBC_TUNABLES).")]
    elif setting != "release":  # a report from before the peers shared the setting
        lines += ["", f"gradsync's jobs, the lone worker and the ceiling ran with `host_memory={setting!r}` "
                      "(on CPU: freed host memory kept for the next step); the peers with the C library's defaults, as a plain "
                      "script runs."]
    lines += [
        "",
        "| PyTorch peer | scaling efficiency | faults/step | final loss | gradsync | scaling efficiency | faults/step | exposed comm | final loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    paired = set()
    for config, row in rows.items():
        if config in CEILINGS or config in PEER_OF.values():
            continue
        peer = rows.get(PEER_OF.get(config, ""))
        chosen = (row.get("chosen") or {}).get("compression")
        each_round = [r["chosen"] for r in row.get("rounds") or [] if r.get("chosen")]
        if len(set(each_round)) > 1:
            chosen = f"{', '.join(each_round)} in its rounds"
        elif len(each_round) > 1:
            chosen = f"{chosen} in every round"
        name = f"`{config}`" + (f" (chose {chosen})" if chosen else "")
        if row.get("periodic_every"):
            name += f" (agrees every {row['periodic_every']} steps)"
        peer_name = ""
        if peer is not None:
            paired.add(peer["config"])
            peer_name = f"`{peer['config']}`"
        lines.append(f"| {peer_name} | {_efficiency(peer)} | {_faults(peer)} | {_loss(peer)} | {name} | {_efficiency(row)} "
                     f"| {_faults(row)} | {_exposed(row)} | {_loss(row)} |")
    for config, row in rows.items():
        if config in PEER_OF.values() and config not in paired:
            lines.append(f"| `{config}` | {_efficiency(row)} | {_faults(row)} | {_loss(row)} | | | | — | |")
    return "\n".join(lines)


def _loss(row: dict[str, Any] | None) -> str:
    return f"{row['final_loss']:.4f}" if row is not None and row.get("final_loss") is not None else ""


def _layout(parallel: dict[str, Any], world: int) -> str:
    """How a strategy spread the model: its mesh, or its pipeline."""
    if parallel.get("strategy") in ("pp", "pp+ddp"):
        dp = f" x dp {parallel['dp_size']}" if parallel.get("dp_size", 1) > 1 else ""
        return f"pp {parallel['pp_size']}{dp}, {parallel['schedule']}, {parallel['microbatches']} micro-batches"
    mesh = parallel.get("mesh")
    return " x ".join(f"{name} {size}" for name, size in mesh.items()) if mesh else f"{world} copies"


def _megabytes(value: float | None) -> str:
    return "—" if value is None else f"{value / 2**20:.1f} MB"


def strategies_table(report: dict[str, Any], command: str) -> str:
    """The Markdown block of the parallel strategies side by side: throughput against the lone
    worker, exposed communication and a pipeline's bubble, what a worker sends and holds, and
    the final loss (every strategy trains the same model on the same global batches)."""
    lines = _heading(report, command) + [
        "",
        "| strategy | layout | samples/s per worker | scaling efficiency | exposed comm | bubble | sent per step | model state | peak RSS | final loss |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["results"]:
        bubble = "—" if row.get("bubble_share") is None else f"{row['bubble_share']:.0%}"
        lines.append(
            f"| {row['config']} | {_layout(row.get('parallel') or {}, report['world_size'])} "
            f"| {row['samples_per_s_per_worker']:.1f} | {_efficiency(row)} | {_exposed(row)} | {bubble} "
            f"| {_megabytes(row.get('traffic_bytes_per_step'))} | {row['state_mb_per_worker']:.1f} MB "
            f"| {row['peak_rss_mb_per_worker']:.0f} MB | {_loss(row)} |"
        )
    return "\n".join(lines)


TABLES = {"peers": peer_table, "strategies": strategies_table}


def splice(text: str, marker: str, block: str) -> str:
    """`text` with what lies between `<!-- marker -->` and `<!-- /marker -->` replaced by `block`."""
    start, end = f"<!-- {marker} -->", f"<!-- /{marker} -->"
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        raise ConfigError(f"the document needs exactly one {start} followed by one {end} around the table to replace.")
    head, rest = text.split(start)
    _, tail = rest.split(end)
    return f"{head}{start}\n{block}\n{end}{tail}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gradsync.bench.tables", description=__doc__.split("\n\n")[0])
    parser.add_argument("report", type=Path, help="report.json of gradsync bench train")
    parser.add_argument("doc", type=Path, help="the Markdown file to update")
    parser.add_argument("--marker", required=True, help="the name in the <!-- NAME --> ... <!-- /NAME --> markers")
    parser.add_argument("--command", required=True, help="the command that produced the report, shown above the table")
    parser.add_argument("--kind", choices=sorted(TABLES), default="peers",
                        help="peers: gradsync's configurations beside PyTorch's (default); strategies: the parallel strategies")
    args = parser.parse_args(argv)
    block = TABLES[args.kind](json.loads(args.report.read_text()), args.command)
    args.doc.write_text(splice(args.doc.read_text(), args.marker, block))


if __name__ == "__main__":
    main()
