"""`gradsync bench`: measurements users run on their own machines and networks."""

from __future__ import annotations

import argparse
import sys

from gradsync.bench import allreduce
from gradsync.cli.launch import launch_module
from gradsync.errors import ConfigError


def add_parser(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="measure all-reduce bandwidth and training configurations")
    kinds = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    sweep = kinds.add_parser(
        "allreduce",
        help="nccl-tests-style all-reduce sweep: time, algbw and busbw per message size",
        description=allreduce.__doc__.splitlines()[0],
    )
    sweep.add_argument("--nproc-per-node", type=int, default=2, help="local worker processes (default 2)")
    allreduce.add_sweep_arguments(sweep)
    sweep.set_defaults(run=run_allreduce)


def run_allreduce(args: argparse.Namespace) -> int:
    if args.nproc_per_node < 2:
        print("gradsync bench allreduce: --nproc-per-node must be at least 2 (an all-reduce needs peers)", file=sys.stderr)
        return 2
    try:
        allreduce.sweep_config(args)  # refuse bad options here, before any worker starts
    except ConfigError as error:
        print(f"gradsync bench allreduce: {error}", file=sys.stderr)
        return 2
    return launch_module("gradsync.bench.allreduce", _worker_args(args), args.nproc_per_node)


def _worker_args(args: argparse.Namespace) -> list[str]:
    worker = ["--min-bytes", args.min_bytes, "--max-bytes", args.max_bytes, "--factor", str(args.factor),
              "--dtype", args.dtype, "--op", args.op, "--iters", str(args.iters)]
    if args.backend:
        worker += ["--backend", args.backend]
    if args.json:
        worker.append("--json")
    if args.output:
        worker += ["--output", args.output]
    return worker
