"""A rank's last words: the lines it wrote just before it ended, and what they say it died of.

A rank that Gloo aborts (SIGABRT) leaves no exit record and no Python traceback; the only
account of why is what the backend printed on its way down (`terminate called after throwing an
instance of 'gloo::EnforceNotMet'` and the enforce's text). The worker's log
(RUN_DIR/workers/attemptN/rankR.log) holds everything the rank wrote, native output included
(run/output.py), so the launcher keeps its tail and sorts it into a few families, each known by
what its messages mean rather than by one example's wording:

- `collective_mismatch`: the two sides of one collective disagree (Gloo's "Received data size
  doesn't match expected size", its older `op.preamble.length <= op.nbytes`, torch's "Detected
  mismatch between collectives" under TORCH_DISTRIBUTED_DEBUG=DETAIL, NCCL's "Mismatched
  collective"); Gloo's enforce also says how many bytes came and how many were posted;
- `out_of_memory`: an allocation failed (std::bad_alloc, the CPU allocator's "can't allocate
  memory", ENOMEM, CUDA or NCCL out of memory, Python's MemoryError);
- `nccl_error`: NCCL reports a fault of its own (ncclInvalidUsage, ncclSystemError, ...);
- `peer_lost` and `backend_timeout`: the transport lost a peer or gave up waiting for one, the
  consequence of another rank's failure rather than a cause;
- `native_abort`: a C++ exception nobody caught, when no family above explains it.

Text only: nothing here reads a rank's records; the rules decide what the family changes. And
the Python stack faulthandler wrote at a fatal signal (`read_fatal_stack`): the user's frames of
the thread the signal stopped, where a native crash was called from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradsync.callsite import is_user_file, short_path
from gradsync.run.analysis.wording import clipped

KEPT_LINES = 20  # of a rank's log: enough for an abort's few lines after a traceback of its own
TAIL_BYTES = 16384  # read from the end of the log, whatever its size
LINE_CHARS = 400  # of one kept line: a message with a tensor's contents is cut

# A line that names the backend speaks for it; a user's own "timed out" does not.
_BACKEND = re.compile(r"gloo|nccl|c10d|ProcessGroup|pair\.cc|enforce fail|[Ww]atchdog|TCPStore", re.IGNORECASE)
# Gloo's enforce: "[enforce fail at FILE:LINE] op.preamble.length <= op.nbytes. 96 vs 64. ..." --
# the bytes the peer sent, then the bytes this rank posted for them.
_GLOO_SIZES = re.compile(r"op\.preamble\.length <= op\.nbytes\.\s*(\d+) vs (\d+)")
_UNCAUGHT = re.compile(r"terminate called after throwing an instance of '([^']+)'")
_WHAT = re.compile(r"what\(\):\s*(.+)")  # the uncaught exception's text, on the line after


@dataclass(frozen=True)
class Family:
    """One kind of last words: what the messages mean, and whether they name a cause or the
    consequence of another rank's failure."""

    name: str
    pattern: re.Pattern[str]
    cause: bool  # False: the transport reacting to a peer (lost, silent)
    backend_only: bool = False  # only on a line that names the backend


# Ordered: a rank's own cause before the consequences it may also have printed, and a
# specific account before the bare "terminate called" that comes with most of them.
FAMILIES = (
    Family(
        "collective_mismatch",
        re.compile(
            r"[Cc]ollective mismatch|doesn't match expected size|op\.preamble\.length <= op\.nbytes|"
            r"[Mm]ismatch(?:ed)? (?:between )?collective"
        ),
        cause=True,
    ),
    Family(
        "out_of_memory",
        re.compile(
            r"bad_alloc|can't allocate memory|[Cc]annot allocate memory|ENOMEM|[Oo]ut of memory|OutOfMemoryError|"
            r"^MemoryError|\bMemoryError:"
        ),
        cause=True,
    ),
    Family(
        "nccl_error",
        re.compile(r"ncclInvalidUsage|ncclInvalidArgument|ncclSystemError|ncclInternalError|ncclUnhandledCudaError"),
        cause=True,
    ),
    Family(
        "peer_lost",
        re.compile(
            r"Connection closed by peer|Connection reset by peer|Broken pipe|ECONNRESET|ncclRemoteError|"
            r"remote process exited|closed by remote|communicator was aborted"
        ),
        cause=False,
        backend_only=True,
    ),
    Family("backend_timeout", re.compile(r"[Tt]imed out|[Tt]imeout"), cause=False, backend_only=True),
    Family("native_abort", _UNCAUGHT, cause=True),
)
CAUSES = frozenset(f.name for f in FAMILIES if f.cause)


@dataclass(frozen=True)
class LastWords:
    """The tail of what one rank wrote, and the family its words belong to (None: none said)."""

    lines: tuple[str, ...]
    family: str | None = None
    said: str | None = None  # the line that told the family
    details: dict[str, Any] = field(default_factory=dict)  # received_bytes/expected_bytes, exception

    @property
    def cause(self) -> bool:
        return self.family in CAUSES

    def quote(self) -> str:
        """The line that told the family, trimmed for a message ("" when none did)."""
        if not self.said:
            return ""
        said = self.said.strip()
        if "what" in self.details:
            said = f"{said}: {self.details['what']}"
        return clipped(said)

    def sizes(self) -> str:
        """'it received 96 bytes where it had posted room for 64' when the backend said the sizes."""
        if "received_bytes" not in self.details:
            return ""
        return f"it received {self.details['received_bytes']} bytes where it had posted room for {self.details['expected_bytes']}"

    def as_dict(self) -> dict[str, Any]:
        return {"family": self.family, "said": self.said, "lines": list(self.lines), **self.details}


def classify(text: str) -> LastWords:
    """The last words in `text` (the end of a rank's output), and their family."""
    lines = tuple(line.rstrip()[:LINE_CHARS] for line in text.splitlines() if line.strip())[-KEPT_LINES:]
    for family in FAMILIES:
        for line in reversed(lines):
            if family.pattern.search(line) and (not family.backend_only or _BACKEND.search(line)):
                return LastWords(lines, family.name, line, _details(family.name, line, lines))
    return LastWords(lines)


def _details(family: str, line: str, lines: tuple[str, ...]) -> dict[str, Any]:
    details: dict[str, Any] = {}
    sizes = _GLOO_SIZES.search(line)
    if sizes:
        details["received_bytes"], details["expected_bytes"] = int(sizes.group(1)), int(sizes.group(2))
    for earlier, after in zip(lines, (*lines[1:], "")):
        uncaught = _UNCAUGHT.search(earlier)
        if uncaught:
            details["uncaught"] = uncaught.group(1)
            what = _WHAT.search(after)
            if what and family == "native_abort":
                details["what"] = what.group(1).strip()
    return details


def read_last_words(path: Path) -> LastWords | None:
    """The last words in a rank's log file; None when it has none (missing, unreadable, empty)."""
    try:
        with open(path, "rb") as log:
            log.seek(0, 2)
            size = log.tell()
            log.seek(max(0, size - TAIL_BYTES))
            tail = log.read()
    except OSError:
        return None
    if size > TAIL_BYTES:
        tail = tail.split(b"\n", 1)[-1]  # the first line read is likely cut
    words = classify(tail.decode(errors="replace"))
    return words if words.lines else None


# faulthandler's dump: one block per Python thread, "Current thread 0x... (most recent call
# first):" for the thread the signal stopped and "Thread 0x... (...)" for the others, each followed
# by one '  File "...", line N in function' per frame, innermost first.
_THREAD = re.compile(r"^(?P<current>Current thread|Thread) 0x[0-9a-fA-F]+")
_FRAME = re.compile(r'^\s+File "(?P<file>.+)", line (?P<line>\d+) in (?P<function>\S+)')
FATAL_BYTES = 65536  # of faulthandler's dump: every thread's stack, 100 frames each at most


def read_fatal_stack(path: Path, working_dir: str | None = None) -> list[str] | None:
    """The user's frames (file:line, innermost first, relative to `working_dir`, the rank's) of the
    thread a fatal signal stopped, from faulthandler's dump at `path` (gradsync run's worker
    writes one per rank); [] when the thread ran none of the user's code, None when there is no
    dump (the rank ended otherwise, or an older gradsync ran it).

    A signal raised on a thread that runs no Python (a backend's own thread aborting on a size
    mismatch, `terminate called ...`) leaves no "Current thread": the main thread's stack, where
    the script made the call that thread serves, is taken instead."""
    try:
        with open(path, "rb") as dump:
            text = dump.read(FATAL_BYTES).decode("utf-8", errors="replace")
    except OSError:
        return None
    threads: list[tuple[bool, list[tuple[str, str, str]]]] = []  # (stopped by the signal, frames)
    for line in text.splitlines():
        thread = _THREAD.match(line)
        if thread is not None:
            threads.append((thread["current"] == "Current thread", []))
            continue
        frame = _FRAME.match(line)
        if frame is not None and threads:
            threads[-1][1].append((frame["file"], frame["line"], frame["function"]))
    chosen = next((frames for current, frames in threads if current), None)
    if chosen is None:  # the main thread: the one threading did not start (its outermost frame is no _bootstrap)
        chosen = next((frames for _, frames in threads if frames and frames[-1][2] != "_bootstrap"), None)
    if chosen is None:
        return None
    return [f"{short_path(file, working_dir)}:{line}" for file, line, _ in chosen if is_user_file(file)]
