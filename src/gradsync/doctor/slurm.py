"""The doctor on Slurm: what the allocation gives each node, against what the launch asks of it.

Slurm tells every process of a job, through SLURM_* variables, how many tasks it starts on each
node, the cores and GPUs they get and which nodes the job has. A launch that disagrees with it
fails in ways whose messages name none of this: two launchers on one node wait in a rendezvous
that expects one, local rank 1 asks for cuda:1 where its task sees one GPU ("invalid device
ordinal"), all workers and their data loaders share one core, a MASTER_ADDR left from another
allocation is never answered.

`SlurmAllocation` reads the variables; `PlannedLaunch` is what `gradsync doctor`'s options ask of
each node; `TaskView` and `RendezvousProbe` are what this task sees of its node and of the
rendezvous host. The `check_*` functions judge them without touching the machine (tests hand them
any allocation), and `preflight` collects and judges in `gradsync doctor`, once per Slurm task,
before it starts its workers: a wrong task count or an unreachable rendezvous hangs the launch,
so afterwards would be too late.
"""

from __future__ import annotations

import itertools
import re
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from gradsync.distributed import usable_cores
from gradsync.doctor.checks import Check
from gradsync.netif import is_loopback, network_interfaces

# The rendezvous of torchrun's c10d backend listens on this port when the endpoint names none.
C10D_DEFAULT_PORT = 29400
STATIC_DEFAULT_PORT = 29500
# How long a node waits for the rendezvous host to answer: srun starts every node's launcher at
# about the same moment, and the serving node's store is up a few seconds after its start.
RENDEZVOUS_WAIT_S = 30.0
CONNECT_TIMEOUT_S = 3.0
# A worker with fewer cores than this shares them with its DataLoader workers and its own threads.
MIN_CORES_PER_WORKER = 2
# Node names resolved to tell whether the rendezvous host is one of the job's nodes.
MAX_NODES_RESOLVED = 64


# -- reading the allocation ------------------------------------------------------------------------


def expand_hostlist(text: str) -> list[str]:
    """Slurm's hostlist syntax ("gpu[001-003,7],login-a[1-2]b") as names, in order."""
    names: list[str] = []
    for piece in _top_level_split(text.strip()):
        parts = re.split(r"(\[[^\]]*\])", piece)
        choices = [_bracket_names(part) if part.startswith("[") else [part] for part in parts if part]
        names.extend("".join(combo) for combo in itertools.product(*choices))
    return names


def _top_level_split(text: str) -> list[str]:
    pieces, depth, current = [], 0, ""
    for char in text:
        depth += char == "["
        depth -= char == "]"
        if char == "," and depth == 0:
            pieces.append(current)
            current = ""
        else:
            current += char
    return [p for p in [*pieces, current] if p]


def _bracket_names(bracket: str) -> list[str]:
    names = []
    for item in bracket[1:-1].split(","):
        low, _, high = item.partition("-")
        if not high:
            names.append(low)
            continue
        width = len(low) if low.startswith("0") else 0  # node[01-10]: keep the padding
        names.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return names


def tasks_per_node(text: str) -> list[int]:
    """SLURM_TASKS_PER_NODE's "2(x3),1" as [2, 2, 2, 1]."""
    counts = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if match is None:
            return []
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


def _int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        match = re.match(r"\s*(\d+)", env.get(name, ""))
        if match:
            return int(match[1])
    return None


def _gpu_count(text: str | None) -> int | None:
    """"8", "a100:8" or "gpu:a100:8" (the count is after the last colon); several types add up."""
    if not text:
        return None
    total = 0
    for item in text.split(","):
        match = re.search(r"(\d+)\s*$", item)
        if match is None:
            return None
        total += int(match[1])
    return total


@dataclass(frozen=True)
class SlurmAllocation:
    """What Slurm says of the job and of this task's node (None: Slurm did not say)."""

    job_id: str
    step_id: str | None  # None: the batch script or an salloc shell, not an srun step
    node: str | None  # SLURMD_NODENAME
    node_index: int | None  # SLURM_NODEID: this node's place in the step's node list
    nodes: tuple[str, ...]  # the step's nodes (the job's outside a step)
    tasks: int | None  # tasks of the step (or the job)
    tasks_on_node: int | None
    cpus_per_task: int | None
    gpus_on_node: int | None

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SlurmAllocation | None:
        job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        if not job_id:
            return None
        step_id = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
        nodes = tuple(expand_hostlist(nodelist))
        node_index = _int(env, "SLURM_NODEID")
        per_node = tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "")
        tasks_on_node = None
        if per_node and node_index is not None and node_index < len(per_node):
            tasks_on_node = per_node[node_index]
        elif per_node and len(set(per_node)) == 1:
            tasks_on_node = per_node[0]
        else:
            tasks_on_node = _int(env, "SLURM_NTASKS_PER_NODE")
        gpus = _int(env, "SLURM_GPUS_ON_NODE")
        if gpus is None:
            gpus = _gpu_count(env.get("SLURM_GPUS_PER_NODE"))
        if gpus is None and env.get("SLURM_JOB_GPUS"):
            gpus = len(env["SLURM_JOB_GPUS"].split(","))
        return cls(
            job_id=job_id, step_id=step_id or None, node=env.get("SLURMD_NODENAME") or None, node_index=node_index,
            nodes=nodes, tasks=_int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"), tasks_on_node=tasks_on_node,
            cpus_per_task=_int(env, "SLURM_CPUS_PER_TASK"), gpus_on_node=gpus,
        )

    @property
    def where(self) -> str:
        node = self.node or "this node"
        if self.node_index is not None and self.nodes:
            node += f" ({self.node_index + 1} of {len(self.nodes)})"
        return f"job {self.job_id}{f' step {self.step_id}' if self.step_id else ''} on {node}"


@dataclass(frozen=True)
class PlannedLaunch:
    """What `gradsync doctor`'s launcher options ask of each node."""

    nproc_per_node: int
    min_nodes: int
    max_nodes: int
    rendezvous: tuple[str, int] | None  # the host and port every node meets at (None: one node)


@dataclass(frozen=True)
class TaskView:
    """What this task sees of its node."""

    hostname: str
    addresses: tuple[str, ...]  # this host's interface addresses
    cores: int  # the cores it may run on (its CPU affinity)
    cuda_devices: int  # torch.cuda.device_count(); 0 without CUDA
    cuda_visible: str | None  # CUDA_VISIBLE_DEVICES as set


@dataclass(frozen=True)
class RendezvousProbe:
    """The rendezvous host as this node sees it."""

    host: str
    port: int
    address: str | None  # what the host resolves to here (None: it does not)
    error: str | None = None  # why it does not resolve, or why it cannot be reached or served
    served_here: bool = False  # the host is this node: its launcher will serve the store
    usable: bool = True  # served here: the port can be bound; elsewhere: a connection was accepted
    refused: bool = False  # elsewhere: every attempt was refused (nothing listened)
    node_addresses: tuple[str, ...] = ()  # what the job's node names resolve to (for "a node of the job?")


# -- judging ---------------------------------------------------------------------------------------


def check_allocation(allocation: SlurmAllocation, launch: PlannedLaunch | None) -> Check:
    parts = [f"{allocation.tasks_on_node if allocation.tasks_on_node is not None else '?'} task(s) on this node"]
    if allocation.cpus_per_task is not None:
        parts.append(f"{allocation.cpus_per_task} CPU(s) per task")
    if allocation.gpus_on_node is not None:
        parts.append(f"{allocation.gpus_on_node} GPU(s) on the node")
    message = ", ".join(parts)
    if launch is None and len(allocation.nodes) > 1:
        message += (". To check the job's nodes together and the network between them, run one doctor per node: "
                    "srun --ntasks-per-node=1 gradsync doctor --nnodes $SLURM_NNODES --nproc-per-node <GPUs per node> "
                    "--rdzv-backend c10d --rdzv-endpoint <first node>:29500 --rdzv-id $SLURM_JOB_ID")
    return Check("slurm job", "ok", allocation.where, message)


def check_tasks(allocation: SlurmAllocation, launch: PlannedLaunch | None) -> Check:
    """One launcher per Slurm task: the rendezvous must expect as many launchers as Slurm starts."""
    name = "slurm tasks"
    if launch is None:
        return Check(name, "ok", "not launched", "this process alone: no rendezvous to meet")
    expected = (str(launch.min_nodes) if launch.min_nodes == launch.max_nodes
                else f"{launch.min_nodes} to {launch.max_nodes}")
    if allocation.step_id is None:
        # The batch script or an salloc shell: SLURM_NTASKS counts the job's tasks, but only this
        # one process launches; srun would start one per task.
        return _outside_a_step(name, allocation, launch, expected)
    launchers = allocation.tasks
    if launchers is None:
        return Check(name, "ok", "unknown", "Slurm did not say how many tasks the step has")
    on_node = allocation.tasks_on_node or 1
    value = (f"{launchers} task(s), {on_node} on this node, each a launcher of {launch.nproc_per_node} worker(s); "
             f"--nnodes {expected}")
    if launch.min_nodes <= launchers <= launch.max_nodes:
        return Check(name, "ok", value, "one launcher per task, as many as the rendezvous expects")
    if launchers > launch.max_nodes:
        what = (f"Slurm starts {launchers} tasks and each runs a launcher, but the rendezvous takes {expected}: the "
                f"extra launchers wait for a place that never comes, or the job starts without them")
        if on_node > 1:
            what += f" ({on_node} launchers on this node would also start {on_node * launch.nproc_per_node} workers on it)"
    else:
        what = (f"the rendezvous waits for {expected} launchers but Slurm starts {launchers}: it hangs until its "
                "join timeout (600 s by default)")
    return Check(name, "problem", value, what,
                 "run one task per node (#SBATCH --ntasks-per-node=1, and srun --ntasks-per-node=1); the launcher "
                 "starts the per-GPU workers itself; and give --nnodes $SLURM_NNODES")


def _outside_a_step(name: str, allocation: SlurmAllocation, launch: PlannedLaunch, expected: str) -> Check:
    value = f"one launcher (not an srun step), --nnodes {expected}; the job has {len(allocation.nodes) or '?'} node(s)"
    if launch.min_nodes > 1:
        return Check(name, "problem", value,
                     f"only this process launches, outside any srun step, and the rendezvous waits for {expected} "
                     "launchers: the other nodes' never start, and it hangs until its join timeout",
                     "start one launcher per node: srun --ntasks-per-node=1 gradsync ...")
    if len(allocation.nodes) > 1:
        return Check(name, "warning", value,
                     f"only this node works: the job holds {len(allocation.nodes)} nodes and the others stay idle",
                     "start one launcher per node: srun --ntasks-per-node=1 gradsync ... --nnodes $SLURM_NNODES")
    return Check(name, "ok", value, "one launcher on the job's one node")


def check_gpus(allocation: SlurmAllocation, launch: PlannedLaunch | None, view: TaskView) -> Check:
    """The GPUs Slurm gave the node, the devices this task sees, and the workers that will use them."""
    name = "slurm gpus"
    given, seen = allocation.gpus_on_node, view.cuda_devices
    workers = launch.nproc_per_node if launch is not None else 1
    visible = f" (CUDA_VISIBLE_DEVICES={view.cuda_visible})" if view.cuda_visible is not None else ""
    value = f"{given if given is not None else 'no'} GPU(s) from Slurm, {seen} visible{visible}"
    if not given and not seen:
        return Check(name, "ok", value, "a CPU job: no GPU asked for, none seen")
    if given and not seen:
        return Check(name, "problem", value,
                     f"Slurm gave this node {given} GPU(s) but torch sees none: this torch has no CUDA, its driver "
                     "does not load, or CUDA_VISIBLE_DEVICES was emptied or overwritten after Slurm set it",
                     "install a CUDA build of torch on the nodes (python -c 'import torch; print(torch.version.cuda)'), "
                     "and leave CUDA_VISIBLE_DEVICES as Slurm sets it")
    if launch is not None and workers > seen:
        return Check(name, "problem", value,
                     f"{workers} workers on this node but this task sees {seen} GPU(s): local ranks {seen} and above "
                     "fail with 'invalid device ordinal' or share a GPU (NCCL: 'Duplicate GPU detected'). Slurm binds "
                     "GPUs per task under --gpus-per-task or --gpu-bind, and a launcher is one task",
                     f"ask for the node's GPUs with --gpus-per-node={workers} (not --gpus-per-task) and one task per "
                     f"node, or start --nproc-per-node {seen}")
    if given is not None and seen > given:
        return Check(name, "warning", value,
                     f"this task sees {seen} GPUs where Slurm gave the node {given}: the others are not this job's and "
                     "another job may be using them (the site does not constrain devices, or CUDA_VISIBLE_DEVICES "
                     "was set by hand)",
                     "leave CUDA_VISIBLE_DEVICES as Slurm sets it, and start as many workers as the GPUs you asked for")
    if launch is not None and (allocation.tasks_on_node or 1) > 1 and seen > workers:
        return Check(name, "problem", value,
                     f"{allocation.tasks_on_node} launchers on this node each see all {seen} GPUs: each gives its "
                     f"workers cuda:0 to cuda:{workers - 1}, so they share those and leave the rest idle",
                     "one task per node with --nproc-per-node equal to the node's GPUs")
    if launch is not None and seen > workers:
        return Check(name, "warning", value, f"{seen - workers} of the {seen} GPUs this task sees stay idle",
                     f"--nproc-per-node {seen}, or ask Slurm for {workers} GPU(s) per node")
    return Check(name, "ok", value, f"{workers} worker(s), one GPU each")


def check_cpus(allocation: SlurmAllocation, launch: PlannedLaunch | None, view: TaskView) -> Check:
    """The cores this task may use, shared by its workers and their DataLoader workers."""
    name = "slurm cpus"
    workers = launch.nproc_per_node if launch is not None else 1
    per_worker = view.cores / workers
    asked = allocation.cpus_per_task
    value = (f"{view.cores} core(s) for this task{f' (--cpus-per-task={asked})' if asked is not None else ''}, "
             f"{per_worker:g} per worker")
    if asked is not None and view.cores < asked:
        return Check(name, "warning", value,
                     f"the job asked for {asked} CPUs per task but this task may run on {view.cores}: srun does not "
                     "inherit --cpus-per-task from sbatch or salloc (Slurm 22.05 and later), so the step bound it to "
                     "fewer. Workers and their data loaders queue for those cores",
                     'srun --cpus-per-task="$SLURM_CPUS_PER_TASK" ... (or export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK)')
    if per_worker < MIN_CORES_PER_WORKER:
        return Check(name, "warning", value,
                     f"{workers} worker(s) share {view.cores} core(s): each worker's main thread, its intra-op threads "
                     "and its DataLoader workers (num_workers) queue for them, and input loading starves the step",
                     f"#SBATCH --cpus-per-task={workers * (MIN_CORES_PER_WORKER + 2)} or more (workers x (num_workers "
                     "+ 1)), passed to srun too")
    return Check(name, "ok", value, "room for each worker's threads and data loaders")


def check_rendezvous(allocation: SlurmAllocation, probe: RendezvousProbe | None) -> Check:
    """The rendezvous host must be a node of this job that every node reaches."""
    name = "slurm rendezvous"
    if probe is None:
        return Check(name, "ok", "one node", "no rendezvous between nodes")
    target = f"{probe.host}:{probe.port}"
    several = len(allocation.nodes) > 1
    first = allocation.nodes[0] if allocation.nodes else "the first node"
    fix_host = (f"use a node of this job, as deploy/slurm/train.sbatch does: --rdzv-endpoint "
                f"$(scontrol show hostnames $SLURM_JOB_NODELIST | sed -n 1p):{probe.port} ({first} here)")
    if probe.address is None:
        return Check(name, "problem", target, f"{probe.host} does not resolve on this node ({probe.error})", fix_host)
    if several and is_loopback(probe.address):
        return Check(name, "problem", f"{target} -> {probe.address}",
                     f"{probe.host} is this node's own loopback address: every node would meet only itself and wait "
                     "for the others until the join timeout", fix_host)
    in_job = probe.host in allocation.nodes or probe.address in probe.node_addresses or probe.served_here
    if probe.served_here and not probe.usable:
        return Check(name, "problem", target,
                     f"this node serves the rendezvous, but port {probe.port} is taken ({probe.error}): another job "
                     "on this node, or an earlier launcher still running",
                     f"choose a port of this job's own, e.g. {probe.host}:$((20000 + SLURM_JOB_ID % 10000))")
    if not probe.served_here and not probe.usable:
        why = ("nothing answered there (the serving node's launcher did not start, or another port was given)"
               if probe.refused else f"no connection ({probe.error}): a firewall or a wrong network")
        return Check(name, "problem", target, f"this node cannot reach {target}: {why}",
                     fix_host if not in_job else "start the same command on every node at once (srun), and open the "
                     "port between the nodes")
    if not in_job:
        return Check(name, "warning", f"{target} -> {probe.address}",
                     f"{probe.host} is not a node of job {allocation.job_id}: a name left from another "
                     "allocation or a login node, which the next job may not reach", fix_host)
    role = "served by this node" if probe.served_here else "reachable"
    return Check(name, "ok", f"{target} -> {probe.address}", f"a node of this job, {role}")


# -- collecting ------------------------------------------------------------------------------------


def task_view(env: Mapping[str, str]) -> TaskView:
    try:
        devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken CUDA set-up is what the GPU check reports
        devices = 0
    addresses = tuple(a for addresses in network_interfaces().values() for a in addresses)
    return TaskView(socket.gethostname(), addresses, usable_cores(), devices, env.get("CUDA_VISIBLE_DEVICES"))


def probe_rendezvous(host: str, port: int, view: TaskView, allocation: SlurmAllocation,
                     wait_s: float = RENDEZVOUS_WAIT_S) -> RendezvousProbe:
    """Resolve the host; where this node serves it, try the port; elsewhere connect, retrying for
    `wait_s` while nothing answers yet (the serving node may start a moment later)."""
    try:
        address = socket.gethostbyname(host)
    except OSError as error:
        return RendezvousProbe(host, port, None, str(error))
    # Only a host the job's node list does not name needs the nodes' addresses (an IP of one of them?).
    node_addresses = () if host in allocation.nodes else tuple(_resolved(allocation.nodes[:MAX_NODES_RESOLVED]))
    served = (host in (view.hostname, view.hostname.split(".")[0]) or address in view.addresses
              or (allocation.node is not None and host == allocation.node))
    if served or is_loopback(address):
        return _bind_probe(host, port, address, node_addresses, served)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with socket.create_connection((address, port), timeout=CONNECT_TIMEOUT_S):
                return RendezvousProbe(host, port, address, node_addresses=node_addresses)
        except ConnectionRefusedError as error:
            refused, last = True, error
        except OSError as error:
            refused, last = False, error
        if time.monotonic() >= deadline:
            return RendezvousProbe(host, port, address, str(last) or type(last).__name__, usable=False,
                                   refused=refused, node_addresses=node_addresses)
        time.sleep(0.5)


def _bind_probe(host: str, port: int, address: str, node_addresses: tuple[str, ...], served: bool) -> RendezvousProbe:
    # SO_REUSEADDR as TCPStore binds: a port a closed connection left in TIME_WAIT is free, one that
    # something listens on is not.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError as error:
            return RendezvousProbe(host, port, address, str(error), served_here=served, usable=False,
                                   node_addresses=node_addresses)
    return RendezvousProbe(host, port, address, served_here=served, node_addresses=node_addresses)


def _resolved(names: Sequence[str]) -> list[str]:
    addresses = []
    for name in names:
        try:
            addresses.append(socket.gethostbyname(name))
        except OSError:
            continue
    return addresses


# Checks whose problem means the launch would hang: `gradsync doctor` reports them and does not launch.
BLOCKING = ("slurm tasks", "slurm rendezvous")


def preflight(env: Mapping[str, str], launch: PlannedLaunch | None) -> list[Check]:
    """This task's Slurm checks ([] outside Slurm), probing the rendezvous host when there is one."""
    allocation = SlurmAllocation.from_env(env)
    if allocation is None:
        return []
    view = task_view(env)
    probe = None
    if launch is not None and launch.rendezvous is not None:
        probe = probe_rendezvous(*launch.rendezvous, view, allocation)
    return [
        check_allocation(allocation, launch),
        check_tasks(allocation, launch),
        check_gpus(allocation, launch, view),
        check_cpus(allocation, launch, view),
        check_rendezvous(allocation, probe),
    ]
