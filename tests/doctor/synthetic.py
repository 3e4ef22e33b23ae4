"""Synthetic per-rank facts: a job of any shape, without the machines."""

from dataclasses import replace

from gradsync.doctor.checks import DiskSpace
from gradsync.doctor.facts import HostFacts, RankFacts

GIB = 1 << 30


def host(**changes) -> HostFacts:
    base = HostFacts(
        interfaces={"lo": ["127.0.0.1"], "eth0": ["10.0.0.2"]}, hostname_address="10.0.0.2", hostname_error=None,
        shm_path="/dev/shm", shm=DiskSpace(16 * GIB, 16 * GIB), nofile=(65536, 65536), checkpoint_dir="/ckpt",
        checkpoint_existing="/ckpt", checkpoint=DiskSpace(500 * GIB, 200 * GIB), checkpoint_writable=True,
    )
    return replace(base, **changes)


def rank(r: int, hostname: str = "hA", local_rank: int | None = None, node: str = "0", gpus: int = 0,
         env: dict | None = None, host_facts: HostFacts | None = None, **changes) -> RankFacts:
    base = RankFacts(
        rank=r, local_rank=r if local_rank is None else local_rank, node=node, hostname=hostname,
        python="3.11.7", torch="2.13.0", cuda="12.4" if gpus else None, cuda_available=bool(gpus),
        gpu_names=("H100",) * gpus, gpu_uuid=None, nccl_available=bool(gpus), nccl="2.21.5" if gpus else None,
        gloo_available=True, env=env or {}, host=host_facts or host(),
    )
    return replace(base, **changes)
