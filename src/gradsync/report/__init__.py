"""`gradsync report RUN_DIR`: one HTML page a user opens to see what a run did and where time went.

It gathers what the other parts of gradsync leave in a run directory (the trainer's
metrics.jsonl, `gradsync run`'s diagnosis.json, the profiler's breakdowns, `gradsync bench
train` reports) into a self-contained page: the pictures are PNGs embedded in the HTML (and
written beside it), with no script or style from the network, so it opens offline and can be
mailed or attached to an issue as one file.
"""

from __future__ import annotations

import base64
import html
import json
import statistics
from pathlib import Path
from typing import Any

from gradsync.errors import GradsyncError
from gradsync.report import figures
from gradsync.report.advice import Advice, advise
from gradsync.report.collect import RunRecords, collect
from gradsync.rundir import RunDir
from gradsync.rundir.records import METRICS_KEYS

__all__ = ["Advice", "RunRecords", "advise", "collect", "write_report"]

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: .5em 0; } td, th { border: 1px solid #ccc; padding: .25em .6em; text-align: left; vertical-align: top; }
.error { color: #a00; font-weight: bold; } .warning { color: #a60; font-weight: bold; } .ok { color: #080; font-weight: bold; }
img { max-width: 100%; } pre { background: #f6f6f6; padding: .6em; overflow-x: auto; }
.skipped { border: 2px solid #a60; padding: 0 .8em; }
"""

# Counts, once the page has loaded, the pictures the browser could decode: a check anyone (and
# the tests, in headless Chromium) can read from the document.
_LOADED_CHECK = (
    "<script>window.addEventListener('load', function () {"
    "var shown = Array.prototype.filter.call(document.images, function (i) { return i.naturalWidth > 0; });"
    "document.body.setAttribute('data-plots-loaded', String(shown.length)); });</script>"
)


def _status(records: RunRecords) -> str:
    """First line of the page: how the run ended, when gradsync run judged it."""
    if records.diagnosis is None:
        return ""
    status = str(records.diagnosis.get("status", "?"))
    return f"<p id='status'>status: <span class='{'ok' if status == 'ok' else 'error'}'>{html.escape(status)}</span></p>"


def _summary(records: RunRecords) -> str:
    rows = records.rows
    if not rows:
        return ""
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
    return "<table>" + "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in cells) + "</table>"


def _advice(advice: list[Advice]) -> str:
    if not advice:
        return ""
    items = "".join(
        f"<li><b>{html.escape(a.measured)}</b>: {html.escape(a.action)}.</li>" for a in advice
    )
    return f"<h2>What to do next</h2><ol id='advice'>{items}</ol>"


def _skipped(records: RunRecords) -> str:
    if not records.skipped:
        return ""
    items = "".join(f"<li>{html.escape(note)}</li>" for note in records.skipped)
    return f"<div class='skipped' id='skipped'><p class='warning'>Left out of this report:</p><ul>{items}</ul></div>"


def _diagnosis(diagnosis: dict[str, Any] | None) -> str:
    if diagnosis is None:
        return ""
    status = str(diagnosis.get("status", "?"))  # said at the top of the page (_status)
    parts = ["<h2>Diagnosis</h2>"]
    findings = diagnosis.get("findings") or []
    if findings:
        parts.append("<table><tr><th>severity</th><th>category</th><th>ranks</th><th>where</th><th>what happened</th><th>what to do</th></tr>")
        for f in findings:
            where = ", ".join(f"rank {r}: {loc}" for r, loc in (f.get("locations") or {}).items())
            severity = str(f.get("severity", ""))
            parts.append(
                f"<tr><td class='{html.escape(severity)}'>{html.escape(severity)}</td><td>{html.escape(str(f.get('category', '')))}</td>"
                f"<td>{html.escape(', '.join(map(str, f.get('ranks', []))))}</td><td>{html.escape(where)}</td>"
                f"<td>{html.escape(str(f.get('message', '')))}</td><td>{html.escape(str(f.get('suggestion', '')))}</td></tr>"
            )
        parts.append("</table>")
    ranks = diagnosis.get("ranks") or {}
    if ranks and status != "ok":  # where each rank stood matters when something went wrong
        parts.append("<pre>" + html.escape("\n".join(f"rank {r}: {line}" for r, line in sorted(ranks.items()))) + "</pre>")
    return "".join(parts)


def _benchmarks(records: RunRecords, pictures: list[tuple[Path, bytes]], pictures_dir: Path) -> str:
    if not records.benchmarks:
        return ""
    from gradsync.bench.train import render

    parts = ["<h2>Benchmarks</h2>"]
    for number, (name, report) in enumerate(records.benchmarks, 1):
        parts.append(f"<h3>{html.escape(name)}</h3><pre>{html.escape(render(report))}</pre>")
        picture = records.run_dir / name / "report.png"
        if picture.is_file():
            parts.append(_image(picture.read_bytes(), f"benchmark {name}", pictures_dir / f"bench-{number}.png", pictures))
    return "".join(parts)


def _image(png: bytes, alt: str, path: Path, pictures: list[tuple[Path, bytes]]) -> str:
    pictures.append((path, png))
    encoded = base64.b64encode(png).decode()
    return f"<p><img class='plot' alt='{html.escape(alt)}' src='data:image/png;base64,{encoded}'></p>"


def _unwritable(page: Path, error: OSError) -> GradsyncError:
    culprit = f" ({error.filename})" if error.filename and Path(error.filename) != page else ""
    return GradsyncError(
        f"cannot write the report to {page}: {error.strerror or error}{culprit}; "
        "give it a file in a folder you can write (gradsync report --output FILE)"
    )


def write_report(run: str | Path | RunRecords, output: str | Path | None = None) -> list[Path]:
    """Write RUN_DIR/report.html (or `output`) and the PNGs it embeds (in report_files/); returns the paths.

    `run` is the run directory, or its records when the caller has read them (to show what was skipped).
    """
    records = run if isinstance(run, RunRecords) else collect(run)
    figures._pyplot()  # a missing matplotlib stops the report here, before anything is written
    page = Path(output) if output is not None else RunDir(records.run_dir).report
    pictures_dir = page.parent / f"{page.stem}_files"
    if page.is_dir():
        raise GradsyncError(f"cannot write the report to {page}: it is a folder; give a file name, e.g. {page / 'report.html'}")
    try:
        pictures_dir.mkdir(parents=True, exist_ok=True)  # an unwritable place fails here, before anything is drawn
    except OSError as error:
        raise _unwritable(page, error) from error
    pictures: list[tuple[Path, bytes]] = []
    failed = (records.diagnosis or {}).get("status") == "failed"
    sections = [_status(records), _skipped(records), _advice(advise(records)), _summary(records)]
    if failed:  # what went wrong comes before how fast it went
        sections.append(_diagnosis(records.diagnosis))
    for title, draw, name in (
        ("Loss and throughput", figures.training_curves, "curves"),
        ("Where a step's time goes", figures.step_breakdown, "breakdown"),
        ("Ranks side by side", figures.rank_heat_maps, "ranks"),
        ("The machines under the ranks", figures.machines_over_time, "machines"),
        ("Exposed communication over time", figures.exposed_communication, "exposed"),
    ):
        png = draw(records)
        if png is not None:
            sections.append(f"<h2>{title}</h2>" + _image(png, title, pictures_dir / f"{name}.png", pictures))
    if not failed:
        sections.append(_diagnosis(records.diagnosis))
    sections.append(_benchmarks(records, pictures, pictures_dir))
    title = html.escape(f"gradsync report: {records.run_dir.resolve().name}")
    try:
        for path, png in pictures:
            path.write_bytes(png)
        page.write_text(
            f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title><style>{_STYLE}</style></head>"
            f"<body><h1>{title}</h1>{''.join(sections)}"
            f"<script type='application/json' id='gradsync-plots'>{json.dumps([p.name for p, _ in pictures])}</script>"
            f"{_LOADED_CHECK}</body></html>"
        )
    except OSError as error:
        raise _unwritable(page, error) from error
    return [page, *(path for path, _ in pictures)]
