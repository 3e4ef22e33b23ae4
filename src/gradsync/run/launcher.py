"""`gradsync run`: torchrun's launcher with a collective recorder in every worker and a diagnosis at the end.

The command line is torchrun's own parser (same options, same PET_* environment variables)
plus gradsync's options; torchrun's elastic agent starts, watches and restarts the workers.
gradsync only swaps the worker command for its recording entry point and watches from the side.
A stop from outside (a scheduler's SIGTERM) reaches the workers through the agent, which gives
them its --shutdown-timeout to save; the launcher then exits 128 + the signal number, as
schedulers expect of a terminated job, with a diagnosis that says it was stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.machinery
import importlib.util
import logging
import os
import sys
import time
from pathlib import Path
from typing import Iterator

from torch.distributed.elastic.agent.server.api import WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import determine_local_world_size, get_args_parser, run

from gradsync import compat
from gradsync.commandline import one_line_errors
from gradsync.distributed import threads_per_worker
from gradsync.errors import ConfigError
from gradsync.report.advice import advice_lines
from gradsync.run import faults, publish
from gradsync.run.analysis.attempts import stopped_by_signal
from gradsync.run.jobwide import rendezvous_store
from gradsync.run.monitor import Monitor
from gradsync.run.moments import ScriptProbe
from gradsync.run.options import ATTEMPT_ENV, RunOptions
from gradsync.rundir import RunDir, fresh, layout


def build_parser(probe: ScriptProbe | None = None) -> argparse.ArgumentParser:
    """torchrun's parser with gradsync's options; `probe`: the script check `--doctor-steps` runs
    (its names are `--doctor-checks`'s choices)."""
    parser = one_line_errors(get_args_parser())
    parser.prog = "gradsync run"
    parser.description = (
        "torchrun, plus a diagnosis of every hang and crash: which rank, which collective, which "
        "line, and what to change. Takes every torchrun option."
    )
    for action in parser._actions:
        if {"--no-python", "--run-path"} & set(action.option_strings):
            action.help = argparse.SUPPRESS  # refused (see _options): not an option to offer
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
    extra.add_argument(
        "--busy-timeout",
        type=float,
        default=None,
        help="seconds ranks may wait in a collective for a rank that keeps working (CPU in its process tree) "
        "without progress: noted at the stall timeout, stopped after this (default 600, NCCL's own timeout, "
        "or the stall timeout if longer)",
    )
    extra.add_argument(
        "--inject-fault",
        action="append",
        default=[],
        metavar="SPEC",
        help="rehearse a failure: ACTION:rank=R:step=S[:attempt=A][:code=C][:at=step|checkpoint], ACTION "
        "kill, hang, stop (SIGSTOP: a frozen process) or exit, e.g. kill:rank=1:step=5; fires on the first attempt unless attempt= says "
        "otherwise (repeatable)",
    )
    extra.add_argument(
        "--record-buckets",
        action="store_true",
        help="record every DDP gradient bucket and check each rank's gradients for NaN/inf before "
        "averaging, naming the parameters where they start (costs a Python comm hook, ~1.5-2 ms per "
        "step; by default DDP keeps its C++ reduction, recorded per backward pass with the loss checked)",
    )
    extra.add_argument(
        "--profile-steps",
        default=None,
        metavar="A:B",
        help="record optimizer steps A..B (from 1) of every rank with torch.profiler: Chrome traces and a "
        "step-time breakdown (forward, backward, exposed communication, optimizer, data) in RUN_DIR/profile",
    )
    extra.add_argument(
        "--flight-recorder",
        type=int,
        default=2000,
        metavar="N",
        help="keep PyTorch's Flight Recorder on in every worker with N entries (default 2000; 0: off): it sees "
        "every collective that reaches a process group (DTensor, functional, compiled ones too) and, on NCCL, "
        "which ones completed; dumps land in RUN_DIR/workers/attemptN/flight, readable by torch's fr_trace",
    )
    extra.add_argument(
        "--show-backend-logs",
        action="store_true",
        help="also print the backend libraries' own log lines (Gloo, NCCL with NCCL_DEBUG, c10 warnings, the "
        "profiler) on the console; they always go to RUN_DIR/workers/attemptN/rank{R}.log",
    )
    extra.add_argument(
        "--doctor-steps",
        type=int,
        default=None,
        metavar="K",
        help="check the script instead of training it: run it for K optimizer steps with heavy checks on "
        "(same batches on every rank, uneven batches, a sampler without set_epoch, accumulation without "
        "no_sync, replicas that drift apart, find_unused_parameters without need), then stop every rank "
        "and report what was found",
    )
    extra.add_argument(
        "--doctor-checks",
        default=None,
        metavar="NAME[,NAME...]",
        help="with --doctor-steps: run only these checks of the script (default: all of them)"
        + (": " + ", ".join(probe.check_names()) if probe is not None else ""),
    )
    return parser


def main(argv: list[str], probe: ScriptProbe | None = None) -> int:
    """`gradsync run ARGV`; `probe`: the script check `--doctor-steps K` runs (the command line
    gives gradsync.doctor.script)."""
    args = build_parser(probe).parse_args(argv)
    try:
        options = _options(args, probe)
    except ConfigError as error:
        print(f"gradsync run: {error}", file=sys.stderr)
        return 2
    return launch(args, options, probe)


def launch(args: argparse.Namespace, options: RunOptions, probe: ScriptProbe | None = None, announce: bool = True) -> int:
    """Run the job torchrun's parsed `args` describe (its rendezvous, workers, script and the
    script's arguments) under gradsync's `options`, and return the exit code: 0 when the diagnosis
    is ok, 1 otherwise, 2 for options that cannot run, 128 + N when stopped by signal N.
    `probe`: the script check whose rules judge what `options.doctor_steps` has the ranks record.
    `announce`: print the diagnosis at the end (else it is only written to the run folder, for a
    caller that has more to add: the doctor's second pass).
    The typed entry of a caller that builds its own options (`gradsync doctor --steps K`)."""
    try:
        check_launch(args, options)
    except ConfigError as error:
        print(f"gradsync run: {error}", file=sys.stderr)
        return 2
    os.environ.pop(ATTEMPT_ENV, None)  # one left by an outer gradsync run is not this launch's count
    folder = RunDir(options.run_dir)
    archived = None
    if _another_node_writes(folder, options.snapshot_interval_s):
        print(f"gradsync run: another node's launch is writing to {options.run_dir} (a shared run folder); sharing it", file=sys.stderr)
    else:
        archived = folder.archive_previous_launch()
    if archived is not None:
        print(f"gradsync run: {options.run_dir} held an earlier launch's records; moved them to {archived}", file=sys.stderr)
    _wrap_worker_command(args, options.save())
    # torchrun would set OMP_NUM_THREADS=1 with a warning; share the cores out instead (a value
    # the user set wins).
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_worker(local_world_size(args.nproc_per_node))))

    min_nodes, max_nodes = node_range(args.nnodes)
    if args.max_restarts > 0 or min_nodes < max_nodes:
        # torchrun shares its rendezvous store with the workers without a per-attempt prefix, so a
        # restarted group can read the replaced group's addresses and fail to connect (4 restarts
        # in 6 here; pytorch/pytorch#135712). A store per attempt avoids it (a value the user set
        # wins). An elastic job restarts its workers whenever a node joins, restarts allowed or not;
        # and each round's own store is what names it on the job board (gradsync.run.jobwide).
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")

    # Taken before torch's run() rewrites the rendezvous options (--standalone becomes c10d on localhost).
    store = rendezvous_store(args)
    if store is not None:
        with contextlib.suppress(OSError):
            store.write(RunDir(options.run_dir).job_board)  # for `gradsync status` and `gradsync stacks`
    monitor = Monitor(options, publish.publish, store, probe=probe)
    monitor.start()
    failures = {}
    stopped_by = None
    with _reporting_restarts(monitor), _agent_logs(RunDir(options.run_dir).launcher_log, options.show_backend_logs):
        try:
            run(args)
        except ChildFailedError as failure:
            failures = failure.failures
        except SignalException as stop:  # the agent already forwarded it and waited for the workers
            stopped_by = stop.sigval
        finally:
            monitor.stop()
    diagnosis = monitor.final(failures)
    if stopped_by is not None:
        grace_s = _shutdown_grace_s(args)
        path = publish.write(stopped_by_signal(diagnosis, stopped_by.name, grace_s), options.run_dir)
        print(
            f"gradsync run: stopped by {stopped_by.name}; workers were asked to stop and given {grace_s} s "
            f"to save (diagnosis: {path})",
            file=sys.stderr,
        )
        return 128 + int(stopped_by)
    if diagnosis["attempt"] in monitor.stall_diagnoses or not announce:
        publish.write(diagnosis, options.run_dir)  # shown when the stall was found, or by the caller
    else:
        publish.publish(diagnosis, options.run_dir)
    for line in advice_lines(options.run_dir):
        print(f"gradsync run: {line}", file=sys.stderr)
    return 0 if diagnosis["status"] == "ok" else 1


def _options(args: argparse.Namespace, probe: ScriptProbe | None) -> RunOptions:
    """gradsync's options from its command line."""
    specs = faults.parse_faults(args.inject_fault)
    # Absolute: a script may change its working directory (os.chdir, Hydra), and the workers
    # write their records there all along.
    run_dir = (Path(args.run_dir) if args.run_dir else fresh()).absolute()
    return RunOptions(
        run_dir=run_dir,
        stall_timeout_s=args.stall_timeout,
        busy_timeout_s=args.busy_timeout,
        faults=tuple(str(s) for s in specs),
        doctor_steps=args.doctor_steps,
        script_probe=probe.__name__ if probe is not None and args.doctor_steps is not None else None,
        doctor_checks=_doctor_checks(args, probe),
        record_buckets=args.record_buckets,
        profile_steps=args.profile_steps,
        show_backend_logs=args.show_backend_logs,
        flight_recorder_entries=args.flight_recorder,
    )


def _doctor_checks(args: argparse.Namespace, probe: ScriptProbe | None) -> list[str] | None:
    """--doctor-checks NAME,...: the names of the checks it selects, in the probe's order (None: all)."""
    if args.doctor_checks is None:
        return None
    if args.doctor_steps is None or probe is None:
        raise ConfigError(
            f"--doctor-checks {args.doctor_checks}: it selects checks of the script check; add --doctor-steps K "
            "(or run `gradsync doctor --steps K --checks ...`)."
        )
    return probe.parse_names(args.doctor_checks, option="--doctor-checks")


def check_launch(args: argparse.Namespace, options: RunOptions) -> None:
    """What would otherwise fail in the workers (or in torch's launcher with a traceback), checked
    before anything is started or written: torchrun's counts, what gradsync cannot watch, the
    script's path, faults that could never fire."""
    local_world_size(args.nproc_per_node)
    min_nodes, max_nodes = node_range(args.nnodes)
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts {args.max_restarts}: give 0 (no restart) or more.")
    if args.node_rank < 0 or (args.rdzv_backend == "static" and not args.standalone and args.node_rank >= max_nodes):
        raise ConfigError(
            f"--node-rank {args.node_rank}: with --nnodes {args.nnodes} give each host a rank from 0 to {max_nodes - 1}."
        )
    for note in compat.check_run(doctor_steps=options.doctor_steps is not None, profile_steps=options.profile_steps is not None,
                                 restarts=args.max_restarts > 0):
        print(f"gradsync run: {note}", file=sys.stderr)
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
    _check_faults_can_fire(tuple(faults.parse_faults(list(options.faults))), args)
    check_target(args.training_script, as_module=args.module)


def local_world_size(nproc_per_node: str) -> int:
    """Workers per host for --nproc-per-node: a count, or torchrun's words (auto, cpu, gpu, ...)."""
    try:
        count = determine_local_world_size(str(nproc_per_node))
    except ValueError as error:
        if str(nproc_per_node) not in ("gpu", "xpu"):  # the words that fail for want of the device
            raise ConfigError(
                f"--nproc-per-node {nproc_per_node}: give the number of worker processes on this host (for GPUs, "
                "one per GPU), or auto, cpu or gpu."
            ) from None
        raise ConfigError(f"--nproc-per-node {nproc_per_node}: {str(error).rstrip('.')} here; give a number instead.") from None
    if count < 1:
        raise ConfigError(f"--nproc-per-node {nproc_per_node}: start at least 1 worker process on this host.")
    return count


def node_range(nnodes: str) -> tuple[int, int]:
    """(min, max) hosts for --nnodes N or MIN:MAX."""
    parts = str(nnodes).split(":")
    if len(parts) > 2 or not all(part.isdigit() for part in parts):
        raise ConfigError(f"--nnodes {nnodes}: give a number of hosts (2) or a range MIN:MAX (1:4) for an elastic job.")
    low, high = int(parts[0]), int(parts[-1])
    if low < 1 or high < low:
        raise ConfigError(f"--nnodes {nnodes}: the range needs 1 <= MIN <= MAX (e.g. 1:4).")
    return low, high


def check_target(target: str, *, as_module: bool) -> None:
    """The script or module exists where the workers will look for it (`python [-m] TARGET` from
    here). Left to the workers, a missing script fails on every rank at once and the diagnosis
    can only say that."""
    if as_module:
        problem = _module_problem(target)
        if problem is not None:
            raise ConfigError(f"-m {target}: {problem}")
        return
    path = Path(target)
    if path.is_dir():
        if not (path / "__main__.py").is_file():
            raise ConfigError(f"{target} is a folder, not a script (it has no __main__.py): give the training script's file.")
    elif not path.is_file():
        raise ConfigError(f"{target}: no such file (from {Path.cwd()}). Check the script's path.")


def _module_problem(name: str) -> str | None:
    """Why `python -m name` would not find the module (None if it would), found without importing
    it or its packages (their code could be slow or have effects)."""
    sys.path.insert(0, os.getcwd())
    try:
        top, *rest = name.split(".")
        spec = importlib.util.find_spec(top) if top else None
        for part in rest:
            if spec is None or not spec.submodule_search_locations:
                break
            spec = importlib.machinery.PathFinder.find_spec(part, list(spec.submodule_search_locations))
        if spec is None:
            return (f"no module named {name!r} on this Python's path (the current folder first, as `python -m` does). "
                    "Check the name, start from the project's root folder, or install its package.")
        if spec.submodule_search_locations and not importlib.machinery.PathFinder.find_spec(
            "__main__", list(spec.submodule_search_locations)
        ):
            return f"{name!r} is a package without a __main__ module: name the module that trains (e.g. {name}.train)."
        return None
    except (ImportError, ValueError) as error:
        return f"cannot be looked up ({error})."
    finally:
        sys.path.remove(os.getcwd())


def _check_faults_can_fire(specs: tuple[faults.FaultSpec, ...], args: argparse.Namespace) -> None:
    """A fault on a rank or attempt the job never has would silently rehearse nothing."""
    world_size = local_world_size(args.nproc_per_node) * node_range(args.nnodes)[1]
    for spec in specs:
        if spec.rank >= world_size:
            raise ConfigError(
                f"--inject-fault {spec}: the job has ranks 0-{world_size - 1}, so rank {spec.rank} never runs; "
                "give a global rank (RANK) of this job."
            )
        if spec.attempt > args.max_restarts:
            raise ConfigError(
                f"--inject-fault {spec}: with --max-restarts {args.max_restarts} the job has attempts "
                f"0-{args.max_restarts}, so attempt {spec.attempt} never runs; raise --max-restarts."
            )


@contextlib.contextmanager
def _reporting_restarts(monitor: Monitor) -> Iterator[None]:
    """Let the monitor learn what the agent saw of each attempt's failures, as soon as it saw them,
    and diagnose each attempt the agent restarts, after its workers stopped, before the next start.

    The agent keeps an attempt's failures (exit codes, signals) to itself and goes straight on to
    the next attempt or ends, so two of its steps are wrapped while the job runs: watching the
    workers (which returns the failures: the monitor publishes them to the other nodes at once,
    before node 0's agent ends and its store with it) and starting a group (which a restart does
    after stopping it). A start that follows no failure is the agent taking in a node that joined
    an elastic job: the healthy workers were stopped for it. Every start is an attempt of its own
    (ATTEMPT_ENV), so that the new group never writes into the folder of the one it replaces.
    """
    watch = compat.AGENT_MONITOR.available()  # without it: said at start (compat.check_run)
    restarts = watch and not compat.missing(compat.RESTARTS)
    if not watch:
        yield
        return
    agent = LocalElasticAgent
    names = ("_monitor_workers", "_initialize_workers") if restarts else ("_monitor_workers",)
    originals = {name: vars(agent).get(name) for name in names}
    monitor_workers, initialize_workers = agent._monitor_workers, agent._initialize_workers
    last_result = []
    started = []

    def watching(self, worker_group):
        result = monitor_workers(self, worker_group)
        last_result[:] = [result]
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            try:
                monitor.agent_ended(result.failures)
            except Exception as error:  # the job-wide view must never take the agent down
                print(f"gradsync run: could not tell the other nodes how this node's workers ended: {error!r}",
                      file=sys.stderr)
        return result

    def starting(self, worker_group):
        if last_result and last_result[0].state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            monitor.restarting(last_result[0].failures)
        elif started:
            monitor.regrouping()
        started.append(True)
        last_result.clear()
        os.environ[ATTEMPT_ENV] = str(monitor.restarts)  # the workers the agent starts now inherit it
        return initialize_workers(self, worker_group)

    agent._monitor_workers = watching
    if restarts:
        agent._initialize_workers = starting
    try:
        yield
    finally:
        os.environ.pop(ATTEMPT_ENV, None)
        for name, original in originals.items():
            if original is None:
                delattr(agent, name)
            else:
                setattr(agent, name, original)


@contextlib.contextmanager
def _agent_logs(path: Path, show: bool) -> Iterator[None]:
    """torchrun's agent logs what it does to the workers ("Sending process closing signal",
    "failed (exitcode: -9)"): the diagnosis says it with the cause, so the agent's own lines go to
    RUN_DIR/launcher.log (and to the console too with --show-backend-logs)."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    loggers = [logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.distributed.run")]
    propagating = [logger.propagate for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.propagate = show
    try:
        yield
    finally:
        for logger, propagate in zip(loggers, propagating):
            logger.removeHandler(handler)
            logger.propagate = propagate
        handler.close()


def _shutdown_grace_s(args: argparse.Namespace) -> int:
    """How long the agent waits for workers after forwarding a stop signal, before SIGKILL.

    torchrun's --shutdown-timeout, else TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30 s (the agent's
    PContext.close timeout; torch versions without the option always wait 30 s).
    """
    explicit = getattr(args, "shutdown_timeout", None)
    return explicit if explicit is not None else int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"))


def _another_node_writes(folder: RunDir, interval_s: float) -> bool:
    """Whether the run folder's worker records belong to a live launch (another node of this job,
    on a shared file system) rather than an earlier one: its snapshots are still being rewritten.
    Moving those aside would take a running job's records away from it."""

    def newest() -> float:
        attempt = folder.latest_attempt()
        if attempt is None:
            return 0.0
        times = [0.0]
        for path in folder.ranks_with(attempt, layout.SNAPSHOT).values():
            try:
                times.append(path.stat().st_mtime)
            except OSError:
                pass
        return max(times)

    before = newest()
    if time.time() - before > 3 * interval_s + 1:
        return False  # quiet for longer than a live rank ever is: an earlier launch
    time.sleep(2 * interval_s + 0.5)
    return newest() > before


def _wrap_worker_command(args: argparse.Namespace, options_path: Path) -> None:
    """`python [-m] TARGET ARGS` becomes `python -m gradsync.run.worker --options F [-m] TARGET ARGS`."""
    target = ["-m", args.training_script] if args.module else [args.training_script]
    args.training_script_args = ["--options", str(options_path), *target, *args.training_script_args]
    args.training_script = "gradsync.run.worker"
    args.module = True
