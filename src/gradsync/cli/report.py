"""`gradsync report RUN_DIR`: write the run's HTML report and say where it is."""

from __future__ import annotations

import argparse
import sys

from gradsync.errors import GradsyncError


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "report",
        help="one self-contained HTML page of a run: curves, step breakdown, ranks side by side, diagnosis, benchmarks",
        description="Write RUN_DIR/report.html (and the PNGs it embeds) from what the run left in RUN_DIR; "
        "open it in any browser, offline.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (gradsync_runs/<time>, or a bench --output-dir)")
    parser.add_argument("--output", default=None, metavar="FILE", help="where the page goes (default RUN_DIR/report.html)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from gradsync.report import collect, write_report  # matplotlib is imported only when a report is drawn

    try:
        records = collect(args.run_dir)
        page, *pictures = write_report(records, args.output)
    except GradsyncError as error:
        print(f"gradsync report: {error}", file=sys.stderr)
        return 2
    for note in records.skipped:
        print(f"gradsync report: skipped {note}", file=sys.stderr)
    print(f"gradsync report: {page} ({len(pictures)} plots); open it in a browser, e.g. xdg-open {page}")
    return 0
