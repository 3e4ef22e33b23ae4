"""`gradsync bench`: measurements users run on their own machines and networks."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Mapping
from typing import Any

from gradsync.bench import allreduce, cluster, train
from gradsync.cli.launch import launch_module
from gradsync.errors import ConfigError, GradsyncError
from gradsync.host_memory import HOST_MEMORY


def add_parser(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="measure all-reduce bandwidth and training configurations")
    kinds = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    sweep = kinds.add_parser(
        "allreduce",
        help="nccl-tests-style all-reduce sweep: time, algbw and busbw per message size",
        description=allreduce.__doc__.splitlines()[0],
    )
    sweep.add_argument("--nproc-per-node", type=int, default=2, help="worker processes per host (default 2)")
    _add_cluster_arguments(sweep)
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
    training.add_argument("--nproc-per-node", type=int, default=2, help="workers per host (default 2)")
    _add_cluster_arguments(training)
    training.add_argument("--steps", type=int, default=30, help="optimizer steps per job after warm-up (default 30)")
    training.add_argument("--warmup", type=int, default=5, help="steps left out of the throughput (default 5)")
    training.add_argument("--rounds", type=int, default=2,
                          help="runs of every configuration, interleaved, the order reversed every other round and "
                               "rotated every two (2 x the number of configs puts each in every place twice); the "
                               "report gives each one's median and spread (default 2)")
    training.add_argument("--batch-size", type=int, default=32, help="samples per worker per step (default 32)")
    training.add_argument("--auto-max-accumulation", type=int, default=1, metavar="K",
                          help="let auto raise accumulation up to K micro-batches per step when communication stays "
                               "exposed; this grows auto's global batch (default 1: never)")
    training.add_argument("--periodic-every", type=int, default=16, metavar="H",
                          help="optimizer steps between the agreements of the diloco and local-sgd configurations "
                               "(default 16)")
    training.add_argument("--host-memory", choices=HOST_MEMORY, default="auto",
                          help="every job's host_memory, the peers' included (given to them through GLIBC_TUNABLES): "
                               "'release' runs everything with the C library's defaults (default auto)")
    training.add_argument("--json", action="store_true", help="print the JSON report instead of a table")
    training.add_argument("--output-dir", default=None, help="write report.json, report.png and report.html here")
    training.set_defaults(run=run_train)


def _add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hosts", type=int, default=0,
                        help="run on N simulated hosts (network namespaces, needs root); default: this host only")
    parser.add_argument("--link", default="1gbit", help="the simulated hosts' link rate, tc syntax (default 1gbit)")


def _simulated_cluster(args: argparse.Namespace, command: str) -> Any:
    """The cluster `--hosts/--link` ask for, or None (localhost) with the reason printed."""
    if not args.hosts:
        return None
    spec = cluster.ClusterSpec(hosts=args.hosts, link=args.link)  # ConfigError on bad input
    reason = cluster.available(spec)
    if reason is not None:
        print(f"gradsync bench {command}: no simulated cluster ({reason}); running on this host only", file=sys.stderr)
        return None
    return cluster.SimulatedCluster(spec)


def run_allreduce(args: argparse.Namespace) -> int:
    try:
        workers = args.nproc_per_node * max(1, args.hosts)
        if workers < 2:
            raise ConfigError("an all-reduce needs at least 2 workers: raise --nproc-per-node or --hosts")
        allreduce.sweep_config(args)  # refuse bad options here, before any worker starts
        simulated = _simulated_cluster(args, "allreduce")
    except ConfigError as error:
        print(f"gradsync bench allreduce: {error}", file=sys.stderr)
        return 2
    if simulated is None:
        return launch_module("gradsync.bench.allreduce", _worker_args(args), workers)
    with simulated:
        return cluster.run_torchrun(simulated, args.nproc_per_node, ["gradsync.bench.allreduce", *_worker_args(args)],
                                    cluster.FIRST_MASTER_PORT)


def _worker_args(args: argparse.Namespace) -> list[str]:
    worker = ["--min-bytes", args.min_bytes, "--max-bytes", args.max_bytes, "--factor", str(args.factor),
              "--dtype", args.dtype, "--op", args.op, "--iters", str(args.iters)]
    if args.backend:
        worker += ["--backend", args.backend]
    if args.json:
        worker.append("--json")
    if args.output:
        worker += ["--output", args.output]
    if args.quiet:
        worker.append("--quiet")
    return worker


def run_train(args: argparse.Namespace) -> int:
    try:
        configs = train.parse_configs(args.configs)
        workers = args.nproc_per_node * max(1, args.hosts)
        if workers < 2:
            raise ConfigError("scaling needs at least 2 workers: raise --nproc-per-node or --hosts")
        if (args.steps < 2 or args.warmup < 1 or args.batch_size < 1 or args.auto_max_accumulation < 1 or args.rounds < 1
                or args.periodic_every < 2):
            raise ConfigError("--steps must be >= 2, --warmup >= 1, --batch-size >= 1, --rounds >= 1, "
                              "--auto-max-accumulation >= 1 and --periodic-every >= 2")
        if args.output_dir:
            from gradsync.bench.plots import pyplot

            pyplot()  # a missing matplotlib is said now, not after minutes of measuring
        simulated = _simulated_cluster(args, "train")
    except GradsyncError as error:
        print(f"gradsync bench train: {error}", file=sys.stderr)
        return 2
    log = (lambda message: print(message, file=sys.stderr)) if args.json else print
    runner = train.local_runner
    if simulated is not None:
        simulated.open()
        ports = itertools.count(cluster.FIRST_MASTER_PORT)  # a fresh port per job: the last job's store may linger

        def on_simulated_hosts(count: int, module_argv: list[str], environment: Mapping[str, str]) -> int:
            # The lone reference needs no network; N workers spread over the hosts.
            if count == 1:
                return train.local_runner(1, module_argv, environment)
            return cluster.run_torchrun(simulated, count // args.hosts, module_argv, next(ports), environment=environment)

        runner = on_simulated_hosts

    try:
        report = train.run_benchmark(
            args.workload, configs, workers=workers, steps=args.steps + args.warmup, warmup=args.warmup,
            batch_size=args.batch_size, rounds=args.rounds, auto_max_accumulation=args.auto_max_accumulation,
            periodic_every=args.periodic_every, host_memory=args.host_memory, runner=runner,
            log=log,
        )
    finally:
        if simulated is not None:
            simulated.close()
    if simulated is not None:
        report["network"] = {"hosts": args.hosts, "link": args.link}
    if args.output_dir:
        from gradsync.bench.plots import write_bench_report

        for path in write_bench_report(report, args.output_dir):
            log(f"wrote {path}")
    print(json.dumps(report) if args.json else train.render(report))
    return 0
