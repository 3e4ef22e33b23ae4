"""`gradsync doctor`: check the environment before a distributed job.

Alone (`gradsync doctor`) it checks this process's view of the machine. With launcher options
(`--nproc-per-node N`, and for several hosts torchrun's `--nnodes --node-rank --master-addr
--master-port` or `--rdzv-*`) it starts its workers through torch.distributed.run, like every
gradsync launch, and also compares the ranks and measures the network between them. Exit code:
0 when every line is ok or a warning, 1 when one is a problem, 2 for bad options.

`gradsync doctor --steps K SCRIPT [ARGS]` checks a training script instead: it launches it as
`gradsync run --doctor-steps K` does, every rank carrying the script check (gradsync.doctor.script)
and stopping after K optimizer steps, and reports like gradsync run; `--checks NAME,...` runs only
those of its checks.
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
from gradsync.doctor import script as script_check
from gradsync.doctor.script import line_trace
from gradsync.doctor import slurm, worker
from gradsync.doctor.checks import worst
from gradsync.errors import ConfigError, GradsyncError
from gradsync.run.options import RunOptions
from gradsync.report.advice import advice_lines
from gradsync.run import publish
from gradsync.rundir import RunDir, fresh, read_json
from gradsync.rundir.records import Finding

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
                             + ", ".join(script_check.check_names()))
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
    """`gradsync doctor --steps K SCRIPT`: the script launched as `gradsync run` launches it, its
    ranks carrying the script check (gradsync.doctor.script) for K optimizer steps, with its
    findings in the same diagnosis.json and terminal layout as every gradsync run. When a part of
    the state parted between two steps and no recorded write explains it, a second run traces that
    window line by line (gradsync.doctor.script.line_trace) and its line replaces the guess."""
    from torch.distributed.run import get_args_parser

    from gradsync.run import launcher

    if args.steps < 1:
        print(f"gradsync doctor: --steps {args.steps}: run the script for at least 1 optimizer step", file=sys.stderr)
        return 2
    try:
        names = script_check.parse_names(args.checks) if args.checks is not None else None
        options = RunOptions(
            # Absolute: a script may change its working directory, and the workers write there all along.
            run_dir=(Path(args.run_dir) if args.run_dir else fresh()).absolute(),
            doctor_steps=args.steps,
            script_probe=script_check.__name__,
            doctor_checks=names,
        )
    except ConfigError as error:
        print(f"gradsync doctor: {error}", file=sys.stderr)
        return 2
    torchrun = get_args_parser().parse_args(
        [*launch.torchrun_options(), "--nproc-per-node", str(launch.nproc_per_node or 1), args.script, *args.script_args]
    )
    code = launcher.launch(torchrun, options, script_check, announce=False)
    diagnosis = read_json(RunDir(options.run_dir).diagnosis)
    if not isinstance(diagnosis, dict):
        return code  # the launch stopped before a diagnosis (bad options): it said why
    localise = next((f for f in diagnosis.get("findings", []) if f.get("details", {}).get("localise")), None)
    if localise is not None and (names is None or "line_trace" in names):
        diagnosis = _second_pass(torchrun, options, diagnosis, localise)
    publish.publish(diagnosis, options.run_dir)
    for line in advice_lines(options.run_dir):
        print(f"gradsync run: {line}", file=sys.stderr)
    return 0 if diagnosis["status"] == "ok" else 1


def _second_pass(torchrun: argparse.Namespace, options: RunOptions, diagnosis: dict, guessed: dict) -> dict:
    """Run the script again up to the window `guessed` names, with only the line trace, and put
    the line it finds in place of the guess (and of what that line explains)."""
    from gradsync.run import launcher

    window, part = guessed["details"]["localise"]["window"], guessed["details"]["localise"]["part"]
    steps = f"{window + 1} step{'s' if window else ''}"
    print(f"gradsync doctor: {line_trace.PARTS[part]} parted across ranks before step {window + 1}, and no recorded "
          f"write explains it: running the script again for {steps}, tracing that window line by line",
          file=sys.stderr, flush=True)
    traced = replace(options, run_dir=RunDir(options.run_dir).second_pass, doctor_steps=window + 1,
                     doctor_checks=["line_trace"], probe_config=line_trace.request(window, part))
    launcher.launch(torchrun, traced, script_check, announce=False)
    second = read_json(RunDir(traced.run_dir).diagnosis)
    found = [f for f in (second or {}).get("findings", []) if f["category"] == "state_parted_at_line"]
    if not found:
        guessed["details"]["second_pass"] = "traced, and no line parted the ranks there (the difference did not come back)"
        return diagnosis
    explained = script_check.explained_by([Finding(**found[0])])
    kept = [f for f in diagnosis["findings"] if f is not guessed and f["category"] not in explained]
    return {**diagnosis, "findings": [found[0], *kept]}


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
