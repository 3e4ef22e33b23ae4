"""The process group: reading the launcher's environment, choosing device and backend, joining.

One script runs everywhere: under torchrun or `gradsync run` it joins the group the launcher
describes (env://); started as a plain `python train.py` it runs as world size 1 with no
process group at all, so nothing waits on peers that do not exist, except under FSDP2 or tensor
parallelism, whose meshes need one: a one-rank group over an in-memory store.
"""

from __future__ import annotations

import atexit
import gc
import os
import socket
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Iterator, Mapping, NoReturn

import torch
import torch.distributed as dist

from gradsync.errors import ConfigError, GradsyncError

# What torchrun (and `gradsync run`) export to every worker.
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistContext:
    """Where this process stands in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None when there is no process group (a lone process)
    owns_process_group: bool  # True when gradsync creates the group and so must destroy it
    # Group for small object collectives (errors, metrics). Under NCCL it is a separate Gloo
    # group so pickled objects never round-trip through GPU memory; under Gloo it is WORLD.
    control_group: Any = None
    # A lone process that still needs a process group (FSDP2 and DTensor build their meshes on
    # one): a one-rank group over an in-memory store, which waits on no one.
    alone_in_memory: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def has_process_group(self) -> bool:
        return self.backend is not None


def read_launcher_env(env: Mapping[str, str]) -> tuple[int, int, int] | None:
    """(rank, world_size, local_rank) from a torchrun-style environment, or None without one."""
    if "WORLD_SIZE" not in env and "RANK" not in env:
        return None
    missing = [name for name in _LAUNCHER_VARS if name not in env]
    if missing:
        raise GradsyncError(
            f"the launcher environment is incomplete: {', '.join(missing)} not set. Start the "
            "script with `gradsync run` or `torchrun`, or unset RANK/WORLD_SIZE to run it as a "
            "single process."
        )
    try:
        rank, world_size, local_rank = (int(env[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    except ValueError as exc:
        raise GradsyncError(f"RANK, WORLD_SIZE and LOCAL_RANK must be integers ({exc}).") from None
    if world_size < 1 or not 0 <= rank < world_size:
        raise GradsyncError(
            f"RANK={rank} and WORLD_SIZE={world_size} are inconsistent: RANK must be in "
            "[0, WORLD_SIZE)."
        )
    return rank, world_size, local_rank


def choose_device(requested: str | None, local_rank: int) -> torch.device:
    """CUDA when available (or asked for), one GPU per local rank; the CPU otherwise."""
    kind = requested or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(
            "device='cuda' but this machine has no usable CUDA device (torch.cuda.is_available() "
            "is False); use device='cpu' or None."
        )
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ConfigError(
            f"local rank {local_rank} needs GPU {local_rank} but this node has {count} GPU(s); "
            f"start at most {count} processes per node (--nproc-per-node {count})."
        )
    return torch.device("cuda", local_rank)


def choose_backend(requested: str | None, device: torch.device) -> str:
    """NCCL for CUDA tensors, Gloo for CPU tensors, unless the user chose."""
    backend = requested or ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError(
            "backend='nccl' only moves CUDA tensors but this run trains on the CPU; use "
            "backend='gloo' (or None), or device='cuda'."
        )
    if not dist.is_available() or not dist.is_backend_available(backend):
        raise ConfigError(
            f"backend {backend!r} is not available in this torch build ({torch.__version__}); "
            "use backend='gloo' or install a torch build with it."
        )
    return backend


def plan_distributed(
    device: str | None, backend: str | None, env: Mapping[str, str] | None = None
) -> DistContext:
    """Decide rank, device and backend from the environment, without joining anything yet.

    Kept free of side effects so every check on it runs before the first collective.
    """
    env = os.environ if env is None else env
    launched = read_launcher_env(env)
    if launched is None:
        return DistContext(0, 1, 0, choose_device(device, 0), None, owns_process_group=False)
    rank, world_size, local_rank = launched
    torch_device = choose_device(device, local_rank)
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise GradsyncError(
                f"a process group is already initialized as rank {dist.get_rank()} of "
                f"{dist.get_world_size()} but the launcher says rank {rank} of {world_size}."
            )
        return DistContext(
            rank, world_size, local_rank, torch_device, dist.get_backend(), owns_process_group=False
        )
    return DistContext(
        rank, world_size, local_rank, torch_device, choose_backend(backend, torch_device),
        owns_process_group=True,
    )


def lone_process_group(ctx: DistContext, backend: str | None) -> DistContext:
    """`ctx` of a lone process, changed to join a one-rank group of its own (see DistContext)."""
    if ctx.backend is not None:
        return ctx
    return replace(ctx, backend=choose_backend(backend, ctx.device), owns_process_group=True, alone_in_memory=True)


def join_process_group(ctx: DistContext, timeout_s: float | None) -> DistContext:
    """Join (or adopt) the process group `ctx` describes; returns it with its control group."""
    if ctx.backend is None:
        return ctx
    if ctx.device.type == "cuda":
        torch.cuda.set_device(ctx.device)
    kwargs = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    if ctx.alone_in_memory:
        dist.init_process_group(ctx.backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    elif ctx.owns_process_group:
        dist.init_process_group(
            ctx.backend, init_method="env://", rank=ctx.rank, world_size=ctx.world_size, **kwargs
        )
    # Pickled objects and small host-side tensors need a backend that takes CPU tensors; pure
    # NCCL does not, so such a job gets a Gloo group beside it.
    control = dist.new_group(backend="gloo", **kwargs) if collective_device().type != "cpu" else None
    return replace(ctx, control_group=control)


def backend_devices(backend: str) -> list[str]:
    """The device types a backend string serves: "nccl" -> ["cuda"], "cpu:gloo,cuda:nccl" -> ["cpu", "cuda"].

    A name torch does not list ("undefined", a plugin) counts as serving the CPU: torch backs an
    undefined group with its default map, whose "cpu" entry is Gloo.
    """
    if ":" in backend:
        return [pair.split(":", 1)[0].strip() for pair in backend.split(",")]
    return list(dist.Backend.backend_capability.get(backend.lower(), ["cpu"]))


def collective_device(group: Any = None) -> torch.device:
    """Where the small tensors gradsync reduces on `group` itself (votes, counts, timings) go.

    The CPU when one of the group's backends takes CPU tensors (Gloo, "cpu:gloo,cuda:nccl");
    else the current CUDA device, as a pure NCCL group only takes CUDA tensors (the process
    has called torch.cuda.set_device before joining, see join_process_group).
    """
    if "cpu" in backend_devices(str(dist.get_backend(group))):
        return torch.device("cpu")
    return torch.device("cuda")


def shutdown(ctx: DistContext, *, barrier: bool = True) -> None:
    """Leave the process group gradsync created.

    A process that exits with its Gloo group still alive can abort in the group's destructor
    ("terminate called without an active exception"), turning a finished run into a failed
    one (3 runs in 10 here); destroying the group first avoids it. The barrier, when every
    rank is known to be here, also keeps a rank from tearing down while a peer is still inside
    its last collective. Without it (a rank leaving alone), nothing waits on peers.
    """
    if ctx.owns_process_group and dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity, which Slurm (--cpus-per-task),
    taskset and container limits narrow. os.cpu_count() counts the machine's, so on a Slurm node
    with 128 cores and --cpus-per-task=8 it would give each of 8 workers 16 threads on one core."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def threads_per_worker(workers: int) -> int:
    """Intra-op threads for each of `workers` processes sharing this process's cores (at least 1)."""
    return max(1, usable_cores() // max(1, workers))


def free_port() -> int:
    """A TCP port nothing listens on now, for a rendezvous this process sets up."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_wrapped_scripts = 0  # how many ends_leave_to_the_wrapper() blocks are open


@contextmanager
def ends_leave_to_the_wrapper() -> Iterator[None]:
    """Inside it, end_process on the main thread raises SystemExit(code) instead of ending there.

    `gradsync run`'s worker runs the user's script inside it: a script that ends with
    end_process (the demo does) must still come back to the worker, which records how the rank
    ended (its exit record, the last Flight Recorder dump) and then ends the process the same way.
    """
    global _wrapped_scripts
    _wrapped_scripts += 1
    try:
        yield
    finally:
        _wrapped_scripts -= 1


def end_process(code: int) -> NoReturn:
    """End a worker process the way multiprocessing ends its children: exit handlers, then os._exit.

    Python's own interpreter teardown races with Gloo's threads: a thread that frees the last
    backward's communication work needs the GIL, finds the interpreter finalizing, and the
    process aborts ("terminate called without an active exception"), turning a finished run
    into a failed one (seen here on a loaded machine in 2 runs of 6 of a plain accumulation
    script, and once in 22 even after a final barrier and destroy_process_group). Running the atexit handlers, collecting garbage while the
    interpreter is whole and flushing the standard streams keeps what a script's exit is
    expected to do, without that race. Inside a script `gradsync run` wraps, the wrapper ends
    the process instead, after recording how the rank ended (ends_leave_to_the_wrapper).
    """
    if _wrapped_scripts and threading.current_thread() is threading.main_thread():
        raise SystemExit(code)
    exit_now(code)


# Captured at import, before `gradsync run`'s worker notes the script's own os._exit calls
# (gradsync.run.script_exit.HardExits): gradsync's endings are not the script's.
_process_exit = os._exit


def exit_on_the_spot(code: int) -> NoReturn:
    """os._exit as Python gives it: gradsync's own immediate endings (an injected fault's exit)."""
    _process_exit(code)


def exit_now(code: int) -> NoReturn:
    """end_process's ending, wherever it is called from: for gradsync's own code that must end
    the process on the spot, inside a wrapped script too (the doctor's stop after K steps)."""
    try:
        atexit._run_exitfuncs()
        gc.collect()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        _process_exit(code)
