"""What one rank sees of its machine: the facts the doctor's checks judge.

Everything here reads the machine (torch, the environment, interfaces, filesystems, limits);
nothing judges. The result is a plain picklable `RankFacts`, gathered from every rank with
`all_gather_object` and compared by `worker.compare`.
"""

from __future__ import annotations

import os
import platform
import resource
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gradsync.doctor.checks import Check, DiskSpace, StoreProbe, relevant_env
from gradsync.netif import network_interfaces

STORE_PROBE_TIMEOUT_S = 3.0
# Without torchrun's agent store, rank 0 serves the store once it starts: others wait for it this long.
STORE_WAIT_S = 30.0
TOPOLOGY_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class HostFacts:
    """The host as one process sees it (every rank collects them; one rank per host is judged)."""

    interfaces: dict[str, list[str]]
    hostname_address: str | None
    hostname_error: str | None
    shm_path: str
    shm: DiskSpace | None
    nofile: tuple[int, int]  # soft, hard; -1 = unlimited
    checkpoint_dir: str
    checkpoint_existing: str | None  # nearest existing folder (itself when it exists)
    checkpoint: DiskSpace | None
    checkpoint_writable: bool
    topology: str | None = None  # `nvidia-smi topo -m`, collected by local rank 0 only
    topology_reason: str | None = None


@dataclass(frozen=True)
class RankFacts:
    rank: int
    local_rank: int
    node: str  # torchrun's GROUP_RANK (node rank) where set: hosts may share a hostname
    hostname: str
    python: str
    torch: str
    cuda: str | None
    cuda_available: bool
    gpu_names: tuple[str, ...]
    gpu_uuid: str | None  # of cuda:LOCAL_RANK, the GPU gradsync gives this rank
    nccl_available: bool
    nccl: str | None
    gloo_available: bool
    env: dict[str, str]
    host: HostFacts
    store: StoreProbe | None = None
    preflight: tuple[Check, ...] = ()  # what `gradsync doctor` found before the launch, on this rank's host

    @property
    def node_key(self) -> tuple[str, str]:
        return (self.hostname, self.node)


def resolve_hostname(hostname: str) -> tuple[str | None, str | None]:
    """(address, None) or (None, error): what socket.gethostbyname says, as Gloo resolves it."""
    try:
        return socket.gethostbyname(hostname), None
    except OSError as error:
        return None, str(error)


def disk_space(path: str | os.PathLike[str], statvfs: Callable[[Any], Any] = os.statvfs) -> DiskSpace | None:
    try:
        return DiskSpace.from_statvfs(statvfs(os.fspath(path)))
    except OSError:
        return None


def existing_folder(path: str | os.PathLike[str]) -> Path | None:
    """`path` itself when it exists, else its nearest existing parent (where it would be created)."""
    current = Path(os.path.abspath(path))
    while not current.exists():
        if current.parent == current:
            return None
        current = current.parent
    return current


def nofile_limit(getrlimit: Callable[[int], tuple[int, int]] = resource.getrlimit) -> tuple[int, int]:
    soft, hard = getrlimit(resource.RLIMIT_NOFILE)
    return tuple(-1 if v == resource.RLIM_INFINITY else int(v) for v in (soft, hard))  # type: ignore[return-value]


def topology() -> tuple[str | None, str | None]:
    """(`nvidia-smi topo -m` output, None) or (None, why it is not shown)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None, "nvidia-smi is not installed: no GPU interconnect to show"
    try:
        done = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=TOPOLOGY_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        return None, f"nvidia-smi topo -m failed: {error}"
    if done.returncode != 0:
        return None, f"nvidia-smi topo -m failed: {(done.stderr or done.stdout).strip()[:200]}"
    return done.stdout, None


def probe_store(rank: int, host: str, address: str, port: int, timeout_s: float = STORE_PROBE_TIMEOUT_S,
                wait_s: float = 0.0) -> StoreProbe:
    """A TCP connect to the launcher's store, with a short timeout.

    wait_s: keep trying that long while the connection is refused, for a store that may not be up
    yet (one that rank 0 serves itself once it starts, as without torchrun).
    """
    started = time.monotonic()
    while True:
        try:
            with socket.create_connection((address, port), timeout=timeout_s):
                pass
        except OSError as error:
            if time.monotonic() - started < wait_s:
                time.sleep(0.25)
                continue
            return StoreProbe(rank, host, address, port, False, time.monotonic() - started,
                              str(error) or type(error).__name__)
        return StoreProbe(rank, host, address, port, True, time.monotonic() - started)


def host_facts(checkpoint_dir: str, shm_path: str, with_topology: bool) -> HostFacts:
    hostname = socket.gethostname()
    address, error = resolve_hostname(hostname)
    existing = existing_folder(checkpoint_dir)
    topo, reason = topology() if with_topology else (None, "shown by local rank 0")
    return HostFacts(
        interfaces=network_interfaces(),
        hostname_address=address,
        hostname_error=error,
        shm_path=shm_path,
        shm=disk_space(shm_path) if os.path.isdir(shm_path) else None,
        nofile=nofile_limit(),
        checkpoint_dir=os.path.abspath(checkpoint_dir),
        checkpoint_existing=None if existing is None else str(existing),
        checkpoint=None if existing is None else disk_space(existing),
        checkpoint_writable=existing is not None and os.access(existing, os.W_OK | os.X_OK),
        topology=topo,
        topology_reason=reason,
    )


def _nccl_version() -> str | None:
    if not dist.is_nccl_available():
        return None
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - a CUDA build without a loadable NCCL
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def rank_facts(
    rank: int, local_rank: int, env: Mapping[str, str], checkpoint_dir: str, shm_path: str
) -> RankFacts:
    cuda_available = torch.cuda.is_available()
    count = torch.cuda.device_count() if cuda_available else 0
    names = tuple(torch.cuda.get_device_name(i) for i in range(count))
    uuid = None
    if 0 <= local_rank < count:
        uuid = str(getattr(torch.cuda.get_device_properties(local_rank), "uuid", "")) or None
    return RankFacts(
        rank=rank,
        local_rank=local_rank,
        node=env.get("GROUP_RANK", ""),
        hostname=socket.gethostname(),
        python=platform.python_version(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        cuda_available=cuda_available,
        gpu_names=names,
        gpu_uuid=uuid,
        nccl_available=dist.is_available() and dist.is_nccl_available(),
        nccl=_nccl_version() if dist.is_available() else None,
        gloo_available=dist.is_available() and dist.is_gloo_available(),
        env=relevant_env(env),
        host=host_facts(checkpoint_dir, shm_path, with_topology=local_rank == 0),
    )
