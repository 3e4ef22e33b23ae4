"""The doctor's per-rank entry point: collect, gather, compare, measure, report.

`gradsync doctor --nproc-per-node N` starts it through torch.distributed.run; it runs under any
launcher too (`torchrun ... -m gradsync.doctor.worker --json`), and `gradsync doctor` alone calls
`run` in its own process (no process group). Each rank collects its facts, probes the launcher's
store, joins a Gloo group, gathers every rank's facts (`all_gather_object`), runs the network tests
(on NCCL when every rank has a GPU of its own, on Gloo otherwise), and every rank builds the same
report from the gathered facts; rank 0 prints it.

A rank that cannot reach the store or join the group prints its own report (the others cannot
help it) and exits 1, so the launcher stops the rest instead of letting them wait.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from gradsync.distributed import end_process, read_launcher_env
from gradsync.doctor import checks as C
from gradsync.doctor.facts import STORE_WAIT_S, RankFacts, probe_store, rank_facts
from gradsync.doctor.summary import Entry, Line, RankInfo, Report, merge, render
from gradsync.errors import ConfigError, GradsyncError
from gradsync.log import configure_logging

# The doctor's own process group: its collectives take seconds, so a peer missing for a minute is gone.
JOIN_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class WorkerOptions:
    json: bool = False
    checkpoint_dir: str = "."
    shm_path: str = "/dev/shm"
    result_dir: str | None = None  # where each rank writes its status for `gradsync doctor` (its exit code)
    started_at: float | None = None  # time.time() when `gradsync doctor` started, for the report's duration
    preflight: tuple[C.Check, ...] = ()  # what `gradsync doctor` found before the launch (its Slurm checks)

    def __post_init__(self) -> None:
        if not self.checkpoint_dir:
            raise ConfigError("--checkpoint-dir: give a folder (default: the current directory)")
        if not self.shm_path:
            raise ConfigError("--shm-path: give the shared-memory mount to check (default /dev/shm)")


@dataclass(frozen=True)
class NetworkOutcome:
    allreduce: C.AllReduceResult | None = None
    pairs: tuple[C.PairResult, ...] = ()
    reason: str | None = None  # why nothing was measured


# --- comparing -----------------------------------------------------------------------------------


def host_labels(facts: Sequence[RankFacts]) -> dict[int, str]:
    """rank -> host name; hosts that share a hostname (containers, namespaces) get their node rank."""
    names: dict[str, set[str]] = {}
    for f in facts:
        names.setdefault(f.hostname, set()).add(f.node)
    return {f.rank: f.hostname if len(names[f.hostname]) == 1 else f"{f.hostname}/node{f.node}" for f in facts}


def device_assignments(facts: Sequence[RankFacts]) -> list[C.DeviceAssignment]:
    hosts = host_labels(facts)
    return [
        C.DeviceAssignment(
            rank=f.rank, host=hosts[f.rank], local_rank=f.local_rank, gpu_count=len(f.gpu_names),
            gpu_name=f.gpu_names[f.local_rank] if 0 <= f.local_rank < len(f.gpu_names) else None,
            gpu_uuid=f.gpu_uuid,
        )
        for f in facts
    ]


def compare(
    facts: Sequence[RankFacts], network: NetworkOutcome, launched: bool, extra: Sequence[C.Check] = ()
) -> list[Line]:
    """Every rank's facts -> the report's lines (the same on every rank that calls it)."""
    facts = sorted(facts, key=lambda f: f.rank)
    hosts = host_labels(facts)
    nodes: dict[tuple[str, str], list[RankFacts]] = {}
    for f in facts:
        nodes.setdefault(f.node_key, []).append(f)
    multi_host = len(nodes) > 1

    def per_rank(judge) -> dict[int, list[C.Check]]:  # type: ignore[no-untyped-def]
        return {f.rank: _as_list(judge(f)) for f in facts}

    def per_host(judge) -> dict[int, list[C.Check]]:  # type: ignore[no-untyped-def]
        # Judged once per host, on its lowest local rank (local rank 0 collected the topology).
        result: dict[int, list[C.Check]] = {}
        for members in nodes.values():
            first = min(members, key=lambda f: f.local_rank)
            checks = _as_list(judge(first))
            for f in members:
                result[f.rank] = checks
        return result

    entries: list[Entry] = [
        per_rank(lambda f: C.check_python(f.python)),
        per_rank(lambda f: C.check_torch(f.torch)),
        per_rank(lambda f: C.check_cuda(f.cuda, f.cuda_available, len(f.gpu_names))),
        per_rank(lambda f: C.check_nccl(f.nccl_available, f.nccl, f.cuda_available)),
        per_rank(lambda f: C.check_gloo(f.gloo_available)),
        C.check_versions([C.Versions(f.rank, hosts[f.rank], f.python, f.torch, f.cuda, f.nccl, f.gloo_available)
                          for f in facts]),
        per_host(lambda f: C.check_gpus(f.gpu_names, f.cuda_available)),
        per_host(lambda f: C.check_topology(f.host.topology, f.host.topology_reason)),
        C.check_device_assignment(device_assignments(facts)),
        per_rank(lambda f: C.check_environment(f.env, f.cuda_available)),
        per_host(lambda f: C.check_network_interface(f.env, f.host.interfaces, f.host.hostname_address,
                                                     multi_host, f.cuda_available)),
        per_host(lambda f: C.check_hostname(f.hostname, f.host.hostname_address, f.host.hostname_error,
                                            multi_host, f.env)),
        per_host(lambda f: list(f.preflight)),
        C.check_store([f.store for f in facts if f.store is not None], launched),
        *extra,
        C.check_allreduce(network.allreduce, network.reason),
        C.check_pairs(network.pairs, hosts, network.reason),
        per_host(lambda f: C.check_shm(f.host.shm_path, f.host.shm, f.cuda_available)),
        per_rank(lambda f: C.check_open_files(*f.host.nofile)),
        per_host(lambda f: C.check_checkpoint_disk(f.host.checkpoint_dir, f.host.checkpoint,
                                                   f.host.checkpoint_writable, f.host.checkpoint_existing)),
    ]
    return merge(entries, [f.rank for f in facts])


def _as_list(result: C.Check | list[C.Check]) -> list[C.Check]:
    return [result] if isinstance(result, C.Check) else list(result)


def build_report(facts: Sequence[RankFacts], network: NetworkOutcome, launched: bool, elapsed_s: float,
                 extra: Sequence[C.Check] = (), scope: str | None = None) -> Report:
    hosts = host_labels(facts)
    return Report(
        lines=tuple(compare(facts, network, launched, extra)),
        ranks=tuple(RankInfo(f.rank, hosts[f.rank], f.local_rank) for f in sorted(facts, key=lambda f: f.rank)),
        elapsed_s=elapsed_s,
        scope=scope,
    )


# --- running -------------------------------------------------------------------------------------


def run(options: WorkerOptions, alone: bool = False) -> int:
    """One rank's doctor; returns the process's exit code.

    alone: `gradsync doctor` without a launcher: this process only, whatever the environment says.
    Under `gradsync doctor`'s launcher (a result_dir) a worker exits 0 after a report, whatever its
    verdict (the command's exit code comes from the result files); elsewhere 1 means a problem.
    """
    # Wall time since `gradsync doctor` started (its launcher passes it), else since this worker did.
    started = options.started_at if options.started_at is not None else time.time()
    launched = None if alone else read_launcher_env(os.environ)  # GradsyncError: a half-set environment
    rank, world_size, local_rank = launched or (0, 1, 0)
    log = configure_logging(rank)
    facts = replace(rank_facts(rank, local_rank, os.environ, options.checkpoint_dir, options.shm_path),
                    preflight=options.preflight)
    if launched is None:
        why = "one process; try --nproc-per-node 2"
        report = build_report([facts], NetworkOutcome(reason=why), launched=False, elapsed_s=time.time() - started)
        return _finish(report, options, rank, printer=True)

    log.info("doctor: checking %d rank(s)", world_size)
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    # Under torchrun the agent serves the store; otherwise rank 0 serves it once it joins (and the
    # others may be up before it is).
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    serves_store = rank == 0 and not agent_store
    probe = None if serves_store else probe_store(rank, facts.hostname, address, port,
                                                  wait_s=0.0 if agent_store else STORE_WAIT_S)
    if probe is not None and not probe.reachable:
        log.error("doctor: cannot reach the store at %s:%d (%s)", address, port, probe.error)
        return _alone_with_problem(replace(facts, store=probe), options, started, None)
    try:
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=JOIN_TIMEOUT_S))
    except Exception as error:  # noqa: BLE001 - any failure to join is the finding
        log.error("doctor: could not join the process group: %s", error)
        joined = C.Check(
            "process group", "problem", "could not join", f"{type(error).__name__}: {str(error)[:300]}",
            "fix the problems above first; otherwise every rank must reach MASTER_ADDR:MASTER_PORT and start "
            "within the rendezvous timeout (read the other ranks' reports)",
        )
        return _alone_with_problem(replace(facts, store=probe), options, started, joined)
    if probe is None:
        probe = probe_store(rank, facts.hostname, address, port)
    gathered: list[RankFacts] = [None] * world_size  # type: ignore[list-item]
    dist.all_gather_object(gathered, replace(facts, store=probe))
    try:
        network, nccl_group = _network(gathered, rank, world_size, local_rank)
    except Exception as error:  # noqa: BLE001 - a collective that fails is what the doctor reports
        log.error("doctor: the network test failed: %s", error)
        failed = C.Check("network test", "problem", "failed", f"{type(error).__name__}: {str(error)[:300]}",
                         "a rank's link or backend fails under load: read each rank's error above, then check "
                         "the interfaces and the firewall between the hosts")
        return _alone_with_problem(replace(facts, store=probe), options, started, failed)
    report = build_report(gathered, network, launched=True, elapsed_s=time.time() - started)
    code = _finish(report, options, rank, printer=rank == 0)
    dist.barrier()
    if nccl_group is not None:
        dist.destroy_process_group(nccl_group)
    dist.destroy_process_group()
    return code


def _network(gathered: Sequence[RankFacts], rank: int, world_size: int, local_rank: int):  # type: ignore[no-untyped-def]
    from gradsync.doctor import network

    if world_size == 1:
        return NetworkOutcome(reason="one rank; try --nproc-per-node 2"), None
    gpu_ranks = all(f.cuda_available and f.nccl_available for f in gathered)
    nccl = gpu_ranks and C.check_device_assignment(device_assignments(gathered)).verdict == "ok"
    group, device, backend = None, torch.device("cpu"), "gloo"
    if nccl:
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
        # CUDA tensors over NCCL; the small CPU tensors the measurement agrees on over Gloo.
        group = dist.new_group(backend="cpu:gloo,cuda:nccl", timeout=timedelta(seconds=JOIN_TIMEOUT_S))
    allreduce = network.allreduce_test(device, backend, group)
    mine = network.pairwise_test(rank, world_size, device, group)
    everyone: list[list[C.PairResult]] = [None] * world_size  # type: ignore[list-item]
    dist.all_gather_object(everyone, mine)
    pairs = tuple(sorted((p for ps in everyone for p in ps), key=lambda p: (p.a, p.b)))
    return NetworkOutcome(allreduce=allreduce, pairs=pairs), group


def _alone_with_problem(facts: RankFacts, options: WorkerOptions, started: float, extra: C.Check | None) -> int:
    """This rank's own report when it cannot be part of the job's; exit 1 so the launcher stops the rest."""
    report = build_report(
        [facts], NetworkOutcome(reason="this rank could not join the others"), launched=True,
        elapsed_s=time.time() - started, extra=[extra] if extra else (),
        scope=f"rank {facts.rank} ({facts.hostname}) alone: it could not join the other ranks",
    )
    _finish(report, options, facts.rank, printer=True)
    return 1


def report_before_launch(checks: Sequence[C.Check], options: WorkerOptions) -> int:
    """The report of `gradsync doctor`'s own checks when they say a launch would hang: printed by
    every task (each sees its own node), exit 1 instead of starting the workers."""
    env = os.environ
    rank = int(env.get("SLURM_PROCID", "0")) if env.get("SLURM_PROCID", "").isdigit() else 0
    report = Report(
        lines=tuple(Line(check) for check in checks),
        ranks=(RankInfo(rank, socket.gethostname(), 0),),
        elapsed_s=time.time() - (options.started_at or time.time()),
        scope="not launched: the workers would wait in a rendezvous that cannot complete (fix the problems below first)",
    )
    _finish(report, options, rank, printer=True)
    return 1


def write_checks(path: Path, checks: Sequence[C.Check]) -> str:
    """`checks` as JSON at `path` (the workers' --preflight); returns the path."""
    path.write_text(json.dumps([asdict(check) for check in checks]))
    return str(path)


def read_checks(path: str) -> tuple[C.Check, ...]:
    return tuple(C.Check(**item) for item in json.loads(Path(path).read_text()))


def _finish(report: Report, options: WorkerOptions, rank: int, printer: bool) -> int:
    if printer:
        _print_at_once(json.dumps(report.to_json()) + "\n" if options.json else render(report))
    problem = report.status == "problem"
    if options.result_dir is not None:
        Path(options.result_dir, f"rank{rank}.json").write_text(json.dumps({"status": report.status}))
        return 0
    return 1 if problem else 0


def _print_at_once(text: str) -> None:
    """Print in one write: ranks that could not join print their own reports at the same moment,
    and a report written in pieces interleaves with another's (seen in CI with --json)."""
    sys.stdout.flush()
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # a stream without a descriptor (a test's capture)
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    data = text.encode()
    while data:
        data = data[os.write(fd, data) :]


def spellings(option: str) -> tuple[str, ...]:
    """`--nproc-per-node` and `--nproc_per_node`: the doctor takes both, as torchrun and `gradsync run` do."""
    underscored = "--" + option.removeprefix("--").replace("-", "_")
    return (option,) if underscored == option else (option, underscored)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options a doctor worker takes (`gradsync doctor` passes them on)."""
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(*spellings("--checkpoint-dir"), default=".", metavar="DIR",
                        help="where checkpoints will go: its free space is checked (default: the current directory)")
    parser.add_argument(*spellings("--shm-path"), default="/dev/shm", metavar="PATH",
                        help="the shared-memory mount to check (default /dev/shm)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gradsync.doctor.worker", description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--result-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--started-at", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--preflight", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        options = WorkerOptions(json=args.json, checkpoint_dir=args.checkpoint_dir, shm_path=args.shm_path,
                                result_dir=args.result_dir, started_at=args.started_at,
                                preflight=read_checks(args.preflight) if args.preflight else ())
        code = run(options)
    except GradsyncError as error:
        print(f"gradsync doctor: {error}", file=sys.stderr)
        end_process(2)
    except Exception:  # noqa: BLE001 - end like every worker, even after a crash (see end_process)
        traceback.print_exc()
        end_process(1)
    end_process(code)


if __name__ == "__main__":
    main()
