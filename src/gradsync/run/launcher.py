"""`gradsync run`: torchrun's launcher with a collective recorder in every worker and a diagnosis at the end.

The command line is torchrun's own parser (same options, same PET_* environment variables)
plus gradsync's options; torchrun's elastic agent starts, watches and restarts the workers.
gradsync only swaps the worker command for its recording entry point and watches from the side.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run

from gradsync.errors import ConfigError
from gradsync.run import report
from gradsync.run.monitor import Monitor
from gradsync.run.options import RunOptions
from gradsync.rundir import fresh_run_dir


def build_parser() -> argparse.ArgumentParser:
    parser = get_args_parser()
    parser.prog = "gradsync run"
    parser.description = (
        "torchrun, plus a diagnosis of every hang and crash: which rank, which collective, which "
        "line, and what to change. Takes every torchrun option."
    )
    extra = parser.add_argument_group("gradsync")
    extra.add_argument(
        "--run-dir",
        default=None,
        help="where worker state and diagnosis.json go (default: gradsync_runs/<time>)",
    )
    extra.add_argument(
        "--stall-timeout",
        type=float,
        default=120.0,
        help="seconds without progress on any rank before the job is diagnosed and stopped (default 120)",
    )
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        options = _options(args)
    except ConfigError as error:
        print(f"gradsync run: {error}", file=sys.stderr)
        return 2
    _wrap_worker_command(args, options.save())
    nproc = args.nproc_per_node
    if str(nproc).isdigit():
        # torchrun would set OMP_NUM_THREADS=1 with a warning; share the cores out instead
        # (a value the user set wins).
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // int(nproc))))

    monitor = Monitor(options, report.publish)
    monitor.start()
    failures = {}
    try:
        run(args)
    except ChildFailedError as failure:
        failures = failure.failures
    finally:
        monitor.stop()
    diagnosis = monitor.final(failures)
    if diagnosis.get("attempt") not in monitor.stall_diagnoses:
        report.publish(diagnosis, options.run_dir)
    return 0 if diagnosis["status"] == "ok" else 1


def _options(args: argparse.Namespace) -> RunOptions:
    if args.no_python:
        raise ConfigError(
            "--no-python: gradsync records collectives inside Python workers, so it cannot watch a "
            "program that is not run by Python; use torchrun for it."
        )
    if args.run_path:
        raise ConfigError(
            "--run-path runs the script inside the launcher process, where the recorder cannot "
            "watch it; drop --run-path (gradsync run starts ordinary worker processes)."
        )
    run_dir = Path(args.run_dir) if args.run_dir else fresh_run_dir()
    return RunOptions(run_dir=run_dir, stall_timeout_s=args.stall_timeout)


def _wrap_worker_command(args: argparse.Namespace, options_path: Path) -> None:
    """`python [-m] TARGET ARGS` becomes `python -m gradsync.run.worker --options F [-m] TARGET ARGS`."""
    target = ["-m", args.training_script] if args.module else [args.training_script]
    args.training_script_args = ["--options", str(options_path), *target, *args.training_script_args]
    args.training_script = "gradsync.run.worker"
    args.module = True
