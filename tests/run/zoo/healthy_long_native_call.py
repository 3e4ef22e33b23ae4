"""Rank 0 spends about 6 s of CPU in ONE native call (hashlib's PBKDF2, sized at run time from a
short probe), while rank 1 waits in dist.broadcast() for its result. The call's Python stack never
changes and rank 0 has no helper thread or child, but its main thread burns a core: the rank is
working, not stuck. Then both ranks all-reduce and exit 0. Plain torchrun: exit 0."""

import hashlib
import os
import time

import torch
import torch.distributed as dist

CPU_SECONDS = 6.0


def iterations_for(cpu_seconds: float) -> int:
    """PBKDF2 iterations that take `cpu_seconds` of CPU here, from a probe of about 0.2 s of CPU."""
    probe, started = 200_000, time.process_time()
    hashlib.pbkdf2_hmac("sha256", b"secret", b"salt", probe)
    return max(probe, int(probe * cpu_seconds / max(time.process_time() - started, 1e-3)))


def main() -> None:
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    key = torch.zeros(4)
    if rank == 0:
        iterations = iterations_for(CPU_SECONDS)
        digest = hashlib.pbkdf2_hmac("sha256", b"secret", b"salt", iterations)  # zoo: native_call
        key = torch.tensor(list(digest[:4]), dtype=torch.float32)
    dist.broadcast(key, src=0)  # zoo: peer_wait
    dist.all_reduce(key)
    print(f"rank {rank}: key sum {float(key.sum()):.0f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
