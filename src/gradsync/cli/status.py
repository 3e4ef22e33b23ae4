"""`gradsync status [RUN_DIR]` and `gradsync stacks [RUN_DIR]`: a running job's ranks, and their
threads' stacks, from any shell on a node of the job (see gradsync.run.status)."""

from __future__ import annotations

import argparse
import sys
import time

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from gradsync.errors import GradsyncError
from gradsync.run.status import JobState, job_line, newest_run, read_job, request_stacks, status_lines, statuses

WATCH_EVERY_S = 1.0


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "status",
        help="every rank of a running job: where it is, its step and step time, CPU, memory, last progress",
        description="One line per rank of a `gradsync run` job, across every node (the others through the "
        "rendezvous store): waiting in a collective, working or idle at file:line; its optimizer step and "
        "recent step time; its process tree's CPU and its memory; seconds since its last progress. After the "
        "job, its last known state.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", nargs="?", default=None,
                        help="the run folder (default: the newest under ./gradsync_runs)")
    parser.add_argument("--watch", action="store_true", help="refresh about once a second (Ctrl-C to stop)")
    parser.set_defaults(run=run_status)
    stacks = commands.add_parser(
        "stacks",
        help="every thread's Python stack on every rank of a running job, without stopping it",
        description="Ask every rank of a `gradsync run` job for all its threads' Python stacks (answered by "
        "gradsync's snapshot thread within about a second, without stopping the job) and print them.",
    )
    stacks.add_argument("run_dir", metavar="RUN_DIR", nargs="?", default=None,
                        help="the run folder (default: the newest under ./gradsync_runs)")
    stacks.add_argument("--wait", type=float, default=4.0, metavar="S", help="seconds to wait for the answers (default 4)")
    stacks.set_defaults(run=run_stacks)


def table(job: JobState) -> Group:
    """The job line (wrapped at the terminal's width), then the ranks' table."""
    ranks = statuses(job)
    grid = Table(expand=False)
    for column in ("rank", "host", "pid", "state", "step", "s/step", "CPU", "RSS", "progress"):
        grid.add_column(column, no_wrap=column != "state", justify="right" if column in ("rank", "pid", "step") else "left")
    for r in ranks:
        grid.add_row(
            str(r.rank), r.host, str(r.pid or "?"), r.state,
            "-" if r.step is None else str(r.step),
            "-" if r.step_time_s is None else f"{r.step_time_s:.3g}",
            "-" if r.cpu_percent is None else f"{r.cpu_percent:.0f}%",
            "-" if r.rss_mb is None else f"{r.rss_mb:,.0f} MB",
            "-" if r.since_progress_s is None else f"{r.since_progress_s:.0f} s ago",
        )
    return Group(Text(job_line(job, ranks)), grid)


def run_status(args: argparse.Namespace) -> int:
    # As wide as the terminal, and wide enough for a line per rank when it is not one (a test's pane, a pipe).
    console = Console(width=None if sys.stdout.isatty() else 200)
    try:
        run_dir = args.run_dir or newest_run()
        job = read_job(run_dir, read_silent=True)
        if not args.watch:
            print("\n".join(status_lines(job)))
            return 0
        with Live(table(job), console=console, refresh_per_second=4, screen=False) as live:
            while not job.ended:
                time.sleep(WATCH_EVERY_S)
                job = read_job(run_dir, job.board, read_silent=True)
                live.update(table(job))
    except GradsyncError as error:
        print(f"gradsync status: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


def run_stacks(args: argparse.Namespace) -> int:
    try:
        job, answers = request_stacks(args.run_dir or newest_run(), wait_s=args.wait)
    except GradsyncError as error:
        print(f"gradsync stacks: {error}", file=sys.stderr)
        return 2
    for rank, state in job.states.items():
        threads = answers.get(rank)
        ended = " (ended; its last stacks)" if "exit" in state else ""
        print(f"rank {rank} ({state.get('host', '?')}, pid {state.get('pid', '?')}){ended}:")
        if threads is None:
            print(f"  no answer within {args.wait:g} s (not heard of: {job.now - float(state.get('time') or 0):.0f} s)")
            continue
        for thread in threads:
            print(f"  thread {thread['thread']!r}{' (main)' if thread.get('main') else ''}:")
            for frame in thread.get("stack") or []:
                print(f"    {frame}")
    return 0 if len(answers) == len(job.states) else 1
