"""The report's text: the header that says what ran, the advice, and a failure told like a compiler error.

A failed run's page reads top to bottom as a user debugs: what failed and where (each named
rank's line quoted with its context), what to do, then what every rank did in its last
seconds. Everything from the run is escaped; nothing is fetched.
"""

from __future__ import annotations

import html
import statistics
import time
from pathlib import Path
from typing import Any

from gradsync.report.advice import Advice
from gradsync.report.collect import RunRecords
from gradsync.rundir.records import METRICS_KEYS

CONTEXT_LINES = 2  # quoted around each named line
LAST_SHOWN = 5  # each rank's last collectives listed under a failure

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; padding: 0 1em; color: #222; overflow-wrap: anywhere; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: .5em 0; } td, th { border: 1px solid #ccc; padding: .25em .6em; text-align: left; vertical-align: top; }
.error { color: #a00; font-weight: bold; } .warning { color: #a60; font-weight: bold; } .ok { color: #080; font-weight: bold; }
img { max-width: 100%; } pre { background: #f6f6f6; padding: .6em; white-space: pre-wrap; }
.skipped { border: 2px solid #a60; padding: 0 .8em; }
.finding { border-left: 4px solid #a00; padding: .1em .9em; margin: 1em 0; background: #fff8f8; }
.finding.warning-finding { border-left-color: #a60; background: #fffbf2; }
.finding pre.source { background: #fff; border: 1px solid #eee; } .finding .mark { color: #a00; font-weight: bold; }
#advice { background: #f2f7ff; border: 1px solid #c8dcff; padding: .6em 2.2em; } .note { color: #555; font-size: .92em; }
"""


def status(records: RunRecords) -> str:
    """First line of the page: how the run ended, when gradsync run judged it."""
    if records.diagnosis is None:
        return ""
    said = str(records.diagnosis.get("status", "?"))
    return f"<p id='status'>status: <span class='{'ok' if said == 'ok' else 'error'}'>{html.escape(said)}</span></p>"


def _wall_time(records: RunRecords) -> float | None:
    description = records.description or {}
    if isinstance(description.get("started"), (int, float)) and isinstance(description.get("ended"), (int, float)):
        return description["ended"] - description["started"]
    started = [w["started"] for w in records.workers.values() if isinstance(w.get("started"), (int, float))]
    ended = [(w.get("exit") or {}).get("time") or w.get("time") for w in records.workers.values()]
    ended = [t for t in ended if isinstance(t, (int, float))]
    return max(ended) - min(started) if started and ended else None


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    return time.strftime("%H:%M:%S", time.gmtime(seconds)) if seconds < 86400 else f"{seconds / 3600:.1f} h"


def _what_ran(records: RunRecords) -> list[tuple[str, str]]:
    """World size, backend, strategy and the trainer's settings, from run.json or the workers."""
    description = records.description or {}
    workers = list(records.workers.values())
    cells: list[tuple[str, str]] = []
    world = description.get("world_size") or (records.diagnosis or {}).get("world_size") or (
        workers[0].get("world_size") if workers else None)
    if world:
        cells.append(("world size", str(world)))
    backend = description.get("backend") if "backend" in description else next(
        (w["backend"] for w in workers if w.get("backend")), None)
    if backend or description:
        cells.append(("backend", str(backend or "none (one process)")))
    if description.get("parallel"):
        cells.append(("strategy", str(description["parallel"])))
    elif workers:
        meshes = next((w["meshes"] for w in workers if w.get("meshes")), None)
        if meshes:
            cells.append(("strategy", "device mesh " + ", ".join(
                "x".join(map(str, m.get("shape", []))) + (f" ({', '.join(m['names'])})" if m.get("names") else "") for m in meshes)))
        elif any(w.get("ddp_parameters") for w in workers):
            cells.append(("strategy", "DDP"))
    for key, label in (("compression", "compression"), ("accumulation_steps", "accumulation (micro-batches per step)"),
                       ("precision", "precision"), ("device", "device")):
        if description.get(key) is not None:
            cells.append((label, str(description[key])))
    wall = _wall_time(records)
    if wall is not None:
        cells.append(("wall time", _duration(wall) + ("" if description.get("ended") or records.workers else " (so far)")))
    return cells


def _how_fast(records: RunRecords) -> list[tuple[str, str]]:
    rows = records.rows
    if not rows:
        found = records.recorded
        if found is None:
            return []
        steps = max(max((row.get("optimizer_steps") or 0) for row in rows) for rows in records.system.values() if rows)
        every = [t for rank in found.ranks for t in found.step_time_s[rank]]
        cells = [
            ("optimizer steps", str(steps)) if steps else ("backward passes", str(found.ends[-1])),
            (f"median time per {found.unit}", f"{1e3 * statistics.median(every):.1f} ms (all ranks)"),
            ("communication", f"{statistics.median(found.communication_share()):.0%} of the time (what the slowest rank "
                              "waited, median over intervals)"),
        ]
        if len(found.ranks) > 1:
            cells.append(("waiting for the slowest rank", f"up to {statistics.median(found.imbalance_share()):.0%} of the "
                                                          "time more (the rank that waited most, median over intervals)"))
        return cells
    last = rows[-1]
    step_ms = 1e3 * statistics.median(r["step_time_s"] for r in rows)
    exposed = sum(r["exposed_comm_s"] for r in rows) / max(1e-12, sum(r["step_time_s"] for r in rows))
    # The median, not the last step (often a short batch), with the spread of the middle 80%.
    rates = sorted(r["samples_per_s"] for r in rows)
    low, high = rates[len(rates) // 10], rates[(len(rates) * 9) // 10 if len(rates) > 1 else 0]
    cells = [
        ("optimizer steps", str(len(rows))),
        ("last loss", f"{last['loss']:.4f}" if isinstance(last.get("loss"), (int, float)) else "—"),
        ("median step time", f"{step_ms:.1f} ms"),
        ("throughput", f"{statistics.median(rates):.0f} samples/s (median; 80% of steps {low:.0f}–{high:.0f})"),
        ("exposed communication", f"{exposed:.1%} of step time"),
    ]
    # The user's own logged values (eval/accuracy, ...): the last one of each.
    for key in sorted({k for r in rows for k in r if k not in METRICS_KEYS and k != "loss"}):
        value = next((r[key] for r in reversed(rows) if isinstance(r.get(key), (int, float))), None)
        if value is not None:
            cells.append((key, f"{value:.4g}"))
    return cells


def header(records: RunRecords) -> str:
    cells = _what_ran(records) + _how_fast(records)
    if not cells:
        return ""
    return "<table id='header'>" + "".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in cells) + "</table>"


def advice(found: list[Advice]) -> str:
    if not found:
        return ""
    items = "".join(f"<li><b>{html.escape(a.measured.rstrip('.'))}</b>: {html.escape(a.action.rstrip('.'))}.</li>" for a in found)
    return f"<h2>What to do next</h2><ol id='advice'>{items}</ol>"


def skipped(records: RunRecords) -> str:
    if not records.skipped:
        return ""
    items = "".join(f"<li>{html.escape(note)}</li>" for note in records.skipped)
    return f"<div class='skipped' id='skipped'><p class='warning'>Left out of this report:</p><ul>{items}</ul></div>"


def quote_source(location: str, base: str | None = None, context: int = CONTEXT_LINES) -> str | None:
    """`path:line` as the lines around it, the named one marked; None when the file is not here
    (a report written on another machine than the ranks ran on). A relative path is relative to
    `base`, the rank's working directory."""
    path, _, number = location.rpartition(":")
    if not number.isdigit() or not path:
        return None
    try:
        lines = (Path(base or ".") / path).read_text(errors="replace").splitlines()
    except OSError:
        return None
    line = int(number)
    if not 1 <= line <= len(lines):
        return None
    first, last = max(1, line - context), min(len(lines), line + context)
    width = len(str(last))
    quoted = []
    for n in range(first, last + 1):
        text = html.escape(f"{n:>{width}} | {lines[n - 1]}")
        quoted.append(f"<span class='mark'>{text}</span>" if n == line else text)
    return "\n".join(quoted)


def _finding(finding: dict[str, Any], workers: dict[int, dict[str, Any]]) -> str:
    severity = str(finding.get("severity", ""))
    ranks = ", ".join(map(str, finding.get("ranks", [])))
    parts = [
        f"<div class='finding{' warning-finding' if severity == 'warning' else ''}'>"
        f"<p><span class='{html.escape(severity)}'>{html.escape(severity)}[{html.escape(str(finding.get('category', '')))}]</span>"
        + (f" ranks {html.escape(ranks)}" if ranks else "") + f": {html.escape(str(finding.get('message', '')))}</p>"
    ]
    seen: set[str] = set()
    for rank, location in (finding.get("locations") or {}).items():
        parts.append(f"<p class='where'>--&gt; rank {html.escape(str(rank))}: <code>{html.escape(str(location))}</code></p>")
        if location not in seen:  # two ranks at one line: quoted once
            seen.add(location)
            worker = workers.get(int(rank)) if str(rank).isdigit() else None
            quoted = quote_source(str(location), (worker or {}).get("cwd"))
            if quoted is not None:
                parts.append(f"<pre class='source'>{quoted}</pre>")
    if finding.get("suggestion"):
        parts.append(f"<p><b>what to do:</b> {html.escape(str(finding['suggestion']))}</p>")
    return "".join(parts) + "</div>"


def diagnosis(records: RunRecords) -> str:
    found = records.diagnosis
    if found is None:
        return ""
    parts = ["<h2>Diagnosis</h2>"]
    findings = found.get("findings") or []
    parts += [_finding(f, records.workers) for f in findings]
    if not findings:
        parts.append("<p>gradsync run found nothing wrong.</p>")
    ranks = found.get("ranks") or {}
    if ranks and found.get("status") != "ok":  # where each rank stood matters when something went wrong
        parts.append("<p>Where each rank stood:</p><pre>" + html.escape(
            "\n".join(f"rank {r}: {line}" for r, line in sorted(ranks.items(), key=lambda item: int(item[0])))) + "</pre>")
    return "".join(parts)


def _record_line(record: dict[str, Any], end: float) -> str:
    name = record["op"] + (f" #{record['seq']}" if record.get("seq") is not None else "")
    what = f"{name} {record.get('signature') or ''}".strip()
    if record.get("kind"):
        what += f" ({record['kind']})"
    if record.get("state") == "failed":
        outcome = f"failed: {record.get('error') or ''}"
    elif record.get("finished") is None:
        outcome = f"never completed (entered {end - record['entered']:.1f} s before the end)"
    else:
        outcome = f"took {1e3 * (record['finished'] - record['entered']):.1f} ms"
    return f"{what} at {record.get('site') or '?'}: {outcome}"


def last_collectives(records: RunRecords) -> str:
    """Each rank's last few collectives as text, newest last (the figure shows their timing)."""
    if not records.failed or not records.collectives:
        return ""
    text = "\n".join(f"rank {rank}:\n" + "\n".join(f"  {_record_line(r, records.last_seen)}" for r in recs[-LAST_SHOWN:])
                     for rank, recs in records.collectives.items())
    return f"<h2>Each rank's last collectives</h2><pre id='last-collectives'>{html.escape(text)}</pre>"


def overlap_note(records: RunRecords) -> str:
    """What the profiler's overlap ratio means, under the breakdown it belongs to."""
    ratios = {rank: b["mean"].get("overlap_ratio") for rank, b in sorted(records.breakdowns.items())}
    ratios = {rank: r for rank, r in ratios.items() if isinstance(r, (int, float))}
    if not ratios:
        return ""
    said = ", ".join(f"rank {rank}: {ratio:.0%}" for rank, ratio in ratios.items())
    return (f"<p class='note'>Overlap ({said}): the share of the gradient communication that ran while backward was still "
            "computing. The rest is exposed: the step waits for it (red above). Low overlap matters only when the exposed "
            "part is a large share of the step; then larger buckets, fewer bytes (compression) or accumulation reduce it.</p>")


AXIS_NOTE = ("<p class='note'>Every plot over time has the same x axis: the optimizer step (the n-th optimizer.step() of the "
             "run; DDP's backward passes where a script's optimizer was not seen, seconds where a run never stepped).</p>")
