"""What the C allocator does with the host memory a training step frees (`host_memory`).

PyTorch's CPU tensors come straight from `malloc`, with no cache of their own (CUDA tensors
have PyTorch's caching allocator). glibc's malloc serves large blocks with fresh `mmap`s and
hands them back on free, and gives the top of its heap back to the OS once enough of it is
free. A training step frees and allocates the same activations and gradients every step, so
on CPU each step takes back from the OS what the last one returned, and every 4 KB page of it
is a page fault. Measured on a 2-core machine (ResNet-18, batch 32, one thread per worker):
20,000-36,000 faults a step at about 2 us each, ~6% of the step, in lone workers and in every
distributed configuration alike, gradsync's and PyTorch's peers.

"reuse" tells glibc, through `mallopt`, never to trim its heap and to serve blocks up to 32 MB
from it from the start, so freed memory stays in the process and the next step reuses it: on
that workload faults fell to a handful a step and the step to ~4-6% less, with the same peak
resident memory. The price is that the process keeps its peak footprint until it exits, which
a training process reaches at its first step anyway. Blocks over 32 MB still come from `mmap`
and fault every time, as under glibc's defaults: 32 MB is the most glibc documents for its
mmap threshold, and serving larger blocks from the heap (M_MMAP_MAX=0) was measured to hold
2-3 times their size in fragments around 64-byte aligned allocations. PyTorch's CPU
performance guide preloads jemalloc or tcmalloc for the same reason; mallopt needs no library
that may be missing, and changes only these two thresholds. It is process-wide and cannot be
undone safely mid-run, so gradsync applies it once, at setup, and says so.

Threads other than the one that trains allocate from arenas of their own, whose heaps glibc
deletes once empty whatever the trim threshold: work done on Gloo's callback threads (int8's
decode) still faults.

Where freed memory does go back to the OS ("release", or no glibc), the trainer at least frees
in the order of PyTorch's own loop: an update's gradients just before the next backward, not
right after the update, where they joined the activations at the heap's free top and tripled
what glibc returned (gradsync.trainer, `_release_spent_gradients`).

A process that gradsync does not set up (a benchmark's peer, an unmodified script) gets the same
two thresholds from its environment: `allocator_environment` gives the GLIBC_TUNABLES that glibc
reads at start-up.

"auto" (the default) reuses when the trainer's device is the CPU; CUDA jobs keep little on the
host and are left alone. Other C libraries (musl, macOS) have no `mallopt` of this kind, and
there nothing changes.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from functools import lru_cache

HOST_MEMORY = ("auto", "reuse", "release")

# glibc's mallopt parameters (malloc.h). M_TRIM_THRESHOLD -1 disables trimming (mallopt(3)).
# Setting either threshold also stops glibc's own adjustment of them, which starts the mmap
# threshold at 128 KB: so both are set, the mmap one to the 32 MB its adjustment ends at.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 32 * 2**20
# The same two settings as glibc tunables (glibc >= 2.26): a trim threshold of SIZE_MAX never
# trims, as mallopt's -1 does; a tunable threshold also stops glibc's own adjustment.
_TUNABLES = f"glibc.malloc.mmap_threshold={_MMAP_THRESHOLD}:glibc.malloc.trim_threshold={2**64 - 1}"


@lru_cache(maxsize=1)
def reuse_freed_memory() -> str | None:
    """Keep freed host memory in this process for reuse (glibc only); what was set, or None
    when this C library has no such setting.

    Cached: a second trainer in the same process finds it done and says the same.
    """
    libc = _glibc()
    if libc is None:
        return None
    if not (libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) and libc.mallopt(_M_TRIM_THRESHOLD, -1)):
        return None
    return "glibc mallopt: M_MMAP_THRESHOLD=32 MB, M_TRIM_THRESHOLD=-1"


def _glibc() -> ctypes.CDLL | None:
    """The C library this process runs on, when it is glibc. Looked up among the symbols the
    process already has (dlopen(NULL)), not with ctypes.util.find_library, which starts
    `ldconfig -p` on every call: once per benchmark job, and a process in make test-fast."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # only glibc has it
        libc.mallopt
    except (OSError, AttributeError):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc


def wants_reuse(setting: str, device_type: str) -> bool:
    """Whether `host_memory=setting` reuses freed memory for a trainer on `device_type`."""
    return setting == "reuse" or (setting == "auto" and device_type == "cpu")


def allocator_environment(setting: str, device_type: str, environment: Mapping[str, str]) -> dict[str, str]:
    """The variables to add to `environment` so that a process started with it keeps freed host
    memory as `host_memory=setting` would (GLIBC_TUNABLES, after any tunables already there);
    none when the setting does not reuse on `device_type`, or the C library is not glibc."""
    if not wants_reuse(setting, device_type) or _glibc() is None:
        return {}
    present = environment.get("GLIBC_TUNABLES")
    return {"GLIBC_TUNABLES": f"{present}:{_TUNABLES}" if present else _TUNABLES}
