"""Every thread's Python stack of a running rank, on demand: `gradsync stacks` asks, the ranks answer.

Why not py-spy or a signal: py-spy needs ptrace rights and a shell on every node, and a signal
handler would replace one the script may have. Every rank under `gradsync run` already runs a
snapshot thread once a second; it reads `sys._current_frames()` (every thread, one pass under
the GIL, a fraction of a millisecond), which stops nothing. A request is a small file in the run
folder (`stacks-request.json`: an id and when it came). Each node's launcher copies a request it
finds in the rendezvous store into its own folder, so the ranks of every node answer (see
gradsync.run.jobwide). A rank answers in its snapshots ("threads", "stacks_id") for HOLD_S
seconds, long enough for its launcher to publish one to the job board whatever the timing. A rank
quiet for half the stall timeout, and every exit record, carry the threads too, so a stopped
job's diagnosis.json keeps the stacks it ended with.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gradsync.callsite import stack_summary
from gradsync.rundir import read_json, write_json

HOLD_S = 10.0  # a request is answered in every snapshot for this long
FRAMES = 40  # innermost frames kept per thread


@dataclass(frozen=True)
class StacksRequest:
    """One `gradsync stacks`: its id (the answers carry it) and when this node got it (time.time())."""

    id: str
    time: float

    @classmethod
    def new(cls) -> StacksRequest:
        return cls(uuid.uuid4().hex[:12], time.time())

    def write(self, path: Path) -> None:
        write_json(path, asdict(self))

    @classmethod
    def read(cls, path: Path) -> StacksRequest | None:
        data = read_json(path)
        if not isinstance(data, dict) or not isinstance(data.get("id"), str) or not isinstance(data.get("time"), (int, float)):
            return None
        return cls(data["id"], float(data["time"]))


class RequestWatch:
    """The worker's side: the request to answer now, if any (the file is read again only when it changed)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen: float | None = None  # the file's mtime at the last read
        self._request: StacksRequest | None = None

    def current(self, now: float) -> StacksRequest | None:
        try:
            changed = os.stat(self.path).st_mtime
        except OSError:
            return None
        if changed != self._seen:
            self._seen, self._request = changed, StacksRequest.read(self.path)
        request = self._request
        return request if request is not None and now - request.time <= HOLD_S else None


def thread_stacks(leave_out: int | None = None) -> list[dict[str, Any]]:
    """Every thread's stack (the main thread first), each "file:line in function" outermost
    first, its innermost FRAMES; `leave_out`: a thread ident not to list (the one asking)."""
    threads = {thread.ident: thread for thread in threading.enumerate()}
    found = []
    for ident, frame in sys._current_frames().items():
        if ident == leave_out:
            continue
        thread = threads.get(ident)
        found.append({
            "thread": thread.name if thread is not None else f"thread {ident}",
            "main": thread is threading.main_thread(),
            "daemon": bool(thread is not None and thread.daemon),
            "stack": stack_summary(frame, limit=FRAMES),
        })
    found.sort(key=lambda t: (not t["main"], t["thread"].startswith("gradsync-"), t["thread"]))
    return found
