"""`gradsync bench`: measurements users run on their own machines and networks."""

from __future__ import annotations

import argparse
import json
import sys

from gradsync.bench import allreduce, train
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

    from gradsync.bench.workloads import WORKLOADS

    training = kinds.add_parser(
        "train",
        help="throughput, scaling efficiency, exposed communication and loss per communication setting",
        description=train.__doc__.split("\n\n")[0],
    )
    training.add_argument("--workload", choices=tuple(WORKLOADS), default="resnet18")
    training.add_argument("--configs", default="fp32,fp16,powersgd,int8,topk,auto",
                          help=f"comma-separated, from {','.join(train.CONFIGS)} (default: %(default)s)")
    training.add_argument("--nproc-per-node", type=int, default=2, help="workers (default 2)")
    training.add_argument("--steps", type=int, default=30, help="optimizer steps per job after warm-up (default 30)")
    training.add_argument("--warmup", type=int, default=5, help="steps left out of the throughput (default 5)")
    training.add_argument("--batch-size", type=int, default=32, help="samples per worker per step (default 32)")
    training.add_argument("--json", action="store_true", help="print the JSON report instead of a table")
    training.add_argument("--output-dir", default=None, help="write report.json and report.png here")
    training.set_defaults(run=run_train)


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


def run_train(args: argparse.Namespace) -> int:
    try:
        configs = train.parse_configs(args.configs)
        if args.nproc_per_node < 2:
            raise ConfigError("--nproc-per-node must be at least 2 (scaling needs several workers)")
        if args.steps < 2 or args.warmup < 1 or args.batch_size < 1:
            raise ConfigError("--steps must be >= 2, --warmup >= 1 and --batch-size >= 1")
    except ConfigError as error:
        print(f"gradsync bench train: {error}", file=sys.stderr)
        return 2
    log = (lambda message: print(message, file=sys.stderr)) if args.json else print
    report = train.run_benchmark(
        args.workload, configs, workers=args.nproc_per_node, steps=args.steps + args.warmup, warmup=args.warmup,
        batch_size=args.batch_size, runner=train.local_runner, log=log,
    )
    if args.output_dir:
        from gradsync.bench.plots import write_report

        for path in write_report(report, args.output_dir):
            log(f"wrote {path}")
    print(json.dumps(report) if args.json else train.render(report))
    return 0
