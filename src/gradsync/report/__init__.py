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
from pathlib import Path
from typing import Any

from gradsync.errors import GradsyncError
from gradsync.report import figures, page
from gradsync.report.advice import Advice, advise
from gradsync.report.collect import RunRecords, collect
from gradsync.rundir import RunDir

__all__ = ["Advice", "RunRecords", "advise", "collect", "write_report"]

# Says, once the page has loaded, how many pictures the browser could decode and whether the
# page is wider than the window (a table or line that runs off the right edge): checks anyone
# (and the tests, in headless Chromium) can read from the document.
_LOADED_CHECK = (
    "<script>window.addEventListener('load', function () {"
    "var shown = Array.prototype.filter.call(document.images, function (i) { return i.naturalWidth > 0; });"
    "document.body.setAttribute('data-plots-loaded', String(shown.length));"
    "document.body.setAttribute('data-wider-than-window', String(document.documentElement.scrollWidth > window.innerWidth));"
    " });</script>"
)


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


def _unwritable(report_page: Path, error: OSError) -> GradsyncError:
    culprit = f" ({error.filename})" if error.filename and Path(error.filename) != report_page else ""
    return GradsyncError(
        f"cannot write the report to {report_page}: {error.strerror or error}{culprit}; "
        "give it a file in a folder you can write (gradsync report --output FILE)"
    )


def write_report(run: str | Path | RunRecords, output: str | Path | None = None) -> list[Path]:
    """Write RUN_DIR/report.html (or `output`) and the PNGs it embeds (in report_files/); returns the paths.

    `run` is the run directory, or its records when the caller has read them (to show what was skipped).
    """
    records = run if isinstance(run, RunRecords) else collect(run)
    figures._pyplot()  # a missing matplotlib stops the report here, before anything is written
    report_page = Path(output) if output is not None else RunDir(records.run_dir).report
    pictures_dir = report_page.parent / f"{report_page.stem}_files"
    if report_page.is_dir():
        raise GradsyncError(f"cannot write the report to {report_page}: it is a folder; give a file name, e.g. {report_page / 'report.html'}")
    try:
        pictures_dir.mkdir(parents=True, exist_ok=True)  # an unwritable place fails here, before anything is drawn
    except OSError as error:
        raise _unwritable(report_page, error) from error
    pictures: list[tuple[Path, bytes]] = []

    def plot(title: str, draw: Any, name: str, note: str = "") -> str:
        png = draw(records)
        return "" if png is None else f"<h2>{title}</h2>" + _image(png, title, pictures_dir / f"{name}.png", pictures) + note

    sections = [page.status(records), page.skipped(records), page.advice(advise(records)), page.header(records)]
    if records.failed:  # what went wrong, where, and what each rank did last, before how fast it went
        sections += [page.diagnosis(records), page.last_collectives(records),
                     plot("The ranks' last seconds", figures.last_collectives, "last-seconds")]
    drawn = [
        plot("Loss and throughput", figures.training_curves, "curves"),
        plot("Where a step's time goes", figures.step_breakdown, "breakdown", page.overlap_note(records)),
        plot("Ranks side by side", figures.rank_heat_maps, "ranks"),
        plot("Step time per rank", figures.step_times, "step-times"),
        plot("Waiting on communication, per rank", figures.communication_waits, "waits"),
        plot("Which rank the others wait for", figures.busy_by_rank, "slowest"),
        plot("The machines under the ranks", figures.machines_over_time, "machines"),
        plot("Exposed communication over time", figures.exposed_communication, "exposed"),
        plot("What the script logged", figures.user_scalars, "logged"),
    ]
    if any(drawn):
        sections += [page.AXIS_NOTE, *drawn]
    if not records.failed:
        sections.append(page.diagnosis(records))
    sections.append(_benchmarks(records, pictures, pictures_dir))
    title = html.escape(f"gradsync report: {records.run_dir.resolve().name}")
    try:
        for path, png in pictures:
            path.write_bytes(png)
        report_page.write_text(
            f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title><style>{page.STYLE}</style></head>"
            f"<body><h1>{title}</h1>{''.join(sections)}"
            f"<script type='application/json' id='gradsync-plots'>{json.dumps([p.name for p, _ in pictures])}</script>"
            f"{_LOADED_CHECK}</body></html>"
        )
    except OSError as error:
        raise _unwritable(report_page, error) from error
    return [report_page, *(path for path, _ in pictures)]
