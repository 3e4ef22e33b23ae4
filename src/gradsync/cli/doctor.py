"""`gradsync doctor`: check the environment before a distributed job.

Alone (`gradsync doctor`) it checks this process's view of the machine. With launcher options
(`--nproc-per-node N`, and for several hosts torchrun's `--nnodes --node-rank --master-addr
--master-port` or `--rdzv-*`) it starts its workers through torch.distributed.run, like every
gradsync launch, and also compares the ranks and measures the network between them. Exit code:
0 when every line is ok or a warning, 1 when one is a problem, 2 for bad options.

`gradsync doctor --steps K SCRIPT [ARGS]` checks a training script instead: it runs it under
`gradsync run --doctor-steps K` (see gradsync.run.script_facts) and reports like gradsync run;
`--checks NAME,...` runs only those of its checks (gradsync.run.scriptcheck.registry).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path

from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from gradsync.cli.launch import launch_module_with
from gradsync.doctor import slurm, worker
from gradsync.doctor.checks import worst
from gradsync.errors import ConfigError, GradsyncError
from gradsync.run.scriptcheck import registry

WORKER_MODULE = "gradsync.doctor.worker"
DEFAULT_STEPS = 20
RDZV_BACKENDS = ("static", "c10d", "etcd", "etcd-v2")


@dataclass(frozen=True)
class LaunchOptions:
    """torchrun's options that `gradsync doctor` takes (None: not given)."""

    nproc_per_node: int | None = None
    nnodes: str | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_backend: str | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    rdzv_conf: str | None = None
    local_addr: str | None = None

    def __post_init__(self) -> None:
        if self.nproc_per_node is not None and self.nproc_per_node < 1:
            raise ConfigError(f"--nproc-per-node {self.nproc_per_node}: start at least 1 worker per host")
        if self.nnodes is not None:
            match = re.fullmatch(r"(\d+)(?::(\d+))?", self.nnodes)
            if match is None or int(match[1]) < 1 or (match[2] is not None and int(match[2]) < int(match[1])):
                raise ConfigError(f"--nnodes {self.nnodes!r}: give a host count (2) or a range MIN:MAX (1:4)")
        if self.node_rank is not None:
            if self.node_rank < 0:
                raise ConfigError(f"--node-rank {self.node_rank}: node ranks start at 0")
            if self.nnodes is not None and ":" not in self.nnodes and self.node_rank >= int(self.nnodes):
                raise ConfigError(f"--node-rank {self.node_rank}: with --nnodes {self.nnodes} use 0 to {int(self.nnodes) - 1}")
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise ConfigError(f"--master-port {self.master_port}: use a TCP port between 1 and 65535")
        if self.rdzv_backend is not None and self.rdzv_backend not in RDZV_BACKENDS:
            raise ConfigError(f"--rdzv-backend {self.rdzv_backend!r}: use one of {', '.join(RDZV_BACKENDS)}")
        if self.several_hosts:
            if self.master_addr is None and self.rdzv_endpoint is None:
                raise ConfigError(
                    f"--nnodes {self.nnodes} needs a meeting point: --master-addr <node 0's address> on every host "
                    "(static rendezvous), or --rdzv-backend c10d --rdzv-endpoint <host:port>"
                )
            if self.rdzv_backend in (None, "static") and self.node_rank is None:
                raise ConfigError(f"--nnodes {self.nnodes} with static rendezvous: give each host its --node-rank (0 on the master's host)")

    @property
    def several_hosts(self) -> bool:
        return self.nnodes is not None and self.nnodes.split(":")[-1] != "1"

    @property
    def launched(self) -> bool:
        return any(getattr(self, f.name) is not None for f in fields(self))

    def planned(self) -> slurm.PlannedLaunch | None:
        """What these options ask of each node (None: no launch, the doctor checks this process)."""
        if not self.launched:
            return None
        low, _, high = (self.nnodes or "1").partition(":")
        rendezvous = None
        if self.several_hosts and self.rdzv_endpoint:
            try:  # torchrun's own reading of HOST[:PORT], [IPv6]:PORT included
                rendezvous = parse_rendezvous_endpoint(self.rdzv_endpoint, default_port=slurm.C10D_DEFAULT_PORT)
            except ValueError:  # a port that is no number: torchrun refuses it at the launch, in its own words
                rendezvous = None
        elif self.several_hosts and self.master_addr:
            rendezvous = (self.master_addr, self.master_port or slurm.STATIC_DEFAULT_PORT)
        return slurm.PlannedLaunch(self.nproc_per_node or 1, int(low), int(high or low), rendezvous)

    def torchrun_options(self) -> list[str]:
        """The rendezvous options torchrun gets (`--standalone` for one host without a meeting point)."""
        if not self.several_hosts and self.master_addr is None and self.rdzv_endpoint is None and self.rdzv_backend is None:
            return ["--standalone"]
        argv = ["--nnodes", self.nnodes or "1"]
        for name in ("node_rank", "master_addr", "master_port", "rdzv_backend", "rdzv_endpoint", "rdzv_id",
                     "rdzv_conf", "local_addr"):
            value = getattr(self, name)
            if value is not None:
                argv += [f"--{name.replace('_', '-')}", str(value)]
        return argv


def _count(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "doctor",
        help="check versions, GPUs, NCCL/Gloo variables, network, /dev/shm, file limits and disk before a job",
        description=__doc__.split("\n\n")[0] + " " + " ".join(__doc__.split("\n\n")[1].split()),
    )
    worker.add_arguments(parser)
    launch = parser.add_argument_group("launcher (torchrun's options; without them the doctor checks this process only)")
    launch.add_argument(*worker.spellings("--nproc-per-node"), type=_count, default=None, metavar="N",
                        help="worker processes per host")
    launch.add_argument("--nnodes", default=None, metavar="N|MIN:MAX", help="hosts in the job")
    launch.add_argument(*worker.spellings("--node-rank"), type=_count, default=None, metavar="R",
                        help="this host's rank (static rendezvous)")
    launch.add_argument(*worker.spellings("--master-addr"), default=None, metavar="ADDR",
                        help="node 0's address (static rendezvous)")
    launch.add_argument(*worker.spellings("--master-port"), type=_count, default=None, metavar="PORT",
                        help="node 0's port (default 29500)")
    launch.add_argument(*worker.spellings("--rdzv-backend"), default=None, metavar="NAME",
                        help=f"one of {', '.join(RDZV_BACKENDS)}")
    launch.add_argument(*worker.spellings("--rdzv-endpoint"), default=None, metavar="HOST:PORT")
    launch.add_argument(*worker.spellings("--rdzv-id"), default=None, metavar="ID")
    launch.add_argument(*worker.spellings("--rdzv-conf"), default=None, metavar="K=V,...")
    launch.add_argument(*worker.spellings("--local-addr"), default=None, metavar="ADDR",
                        help="this host's address, where the hostname does not resolve")
    script = parser.add_argument_group("script check (instead of the environment checks)")
    script.add_argument("--steps", type=_count, default=DEFAULT_STEPS, metavar="K",
                        help=f"optimizer steps to run SCRIPT for (default {DEFAULT_STEPS})")
    script.add_argument("--checks", default=None, metavar="NAME[,NAME...]",
                        help="run only these checks of the script (default: all of them): "
                             + ", ".join(registry.check_names()))
    script.add_argument(*worker.spellings("--run-dir"), default=None, metavar="DIR",
                        help="where diagnosis.json goes (default gradsync_runs/<time>)")
    script.add_argument("script", nargs="?", default=None, metavar="SCRIPT",
                        help="your unmodified training script: run under `gradsync run --doctor-steps K` and checked "
                             "for the silent mistakes (same sampler on every rank, uneven batches, diverged replicas, ...)")
    script.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="the script's own arguments")
    parser.set_defaults(run=run)


def launch_options(args: argparse.Namespace) -> LaunchOptions:
    return LaunchOptions(**{f.name: getattr(args, f.name) for f in fields(LaunchOptions)})


def check_script(args: argparse.Namespace, launch: LaunchOptions) -> int:
    """`gradsync doctor --steps K SCRIPT`: the script under `gradsync run --doctor-steps K`, with its
    findings in the same diagnosis.json and terminal layout as every gradsync run."""
    from gradsync.run import launcher

    if args.steps < 1:
        print(f"gradsync doctor: --steps {args.steps}: run the script for at least 1 optimizer step", file=sys.stderr)
        return 2
    argv = ["--doctor-steps", str(args.steps), *launch.torchrun_options(), "--nproc-per-node", str(launch.nproc_per_node or 1)]
    if args.checks is not None:
        try:
            names = registry.parse_names(args.checks)
        except ConfigError as error:
            print(f"gradsync doctor: {error}", file=sys.stderr)
            return 2
        argv += ["--doctor-checks", ",".join(names)]
    if args.run_dir is not None:
        argv += ["--run-dir", args.run_dir]
    return launcher.main([*argv, args.script, *args.script_args])


def run(args: argparse.Namespace) -> int:
    started = time.time()
    try:
        options = worker.WorkerOptions(json=args.json, checkpoint_dir=args.checkpoint_dir, shm_path=args.shm_path,
                                       started_at=started)
        launch = launch_options(args)
    except ConfigError as error:
        print(f"gradsync doctor: {error}", file=sys.stderr)
        return 2
    if args.script is None and (args.steps != DEFAULT_STEPS or args.run_dir is not None or args.checks is not None):
        print("gradsync doctor: --steps, --checks and --run-dir belong to the script check: add the SCRIPT to run",
              file=sys.stderr)
        return 2
    # On Slurm, what the allocation gives this task against what the launch asks of it: before the
    # launch (the script check's too), which a wrong task count or an unreachable rendezvous would hang.
    preflight = tuple(slurm.preflight(os.environ, launch.planned()))
    if any(c.verdict == "problem" and c.name in slurm.BLOCKING for c in preflight):
        return worker.report_before_launch(preflight, options)
    if args.script is not None:
        return check_script(args, launch)
    options = replace(options, preflight=preflight)
    if not launch.launched:
        try:
            return worker.run(options, alone=True)
        except GradsyncError as error:
            print(f"gradsync doctor: {error}", file=sys.stderr)
            return 2
    worker_args = ["--checkpoint-dir", options.checkpoint_dir, "--shm-path", options.shm_path, "--started-at", str(started)]
    if options.json:
        worker_args.append("--json")
    with tempfile.TemporaryDirectory(prefix="gradsync-doctor-") as results:
        if preflight:
            worker_args += ["--preflight", worker.write_checks(Path(results) / "preflight.json", preflight)]
        code = launch_module_with(launch.torchrun_options(), WORKER_MODULE, [*worker_args, "--result-dir", results],
                                  launch.nproc_per_node or 1)
        statuses = [json.loads(path.read_text())["status"] for path in Path(results).glob("rank*.json")]
    if not statuses:
        print("gradsync doctor: no worker finished its report; their output is above", file=sys.stderr)
        return 1
    return 1 if code != 0 or worst(statuses) == "problem" else 0
