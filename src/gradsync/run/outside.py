"""A rank's Python stacks read from outside its process, as `py-spy dump` reads them.

A rank reports where it is from a thread of its own (gradsync.run.worker's snapshot thread). That
thread needs the GIL: a rank whose main thread holds it inside a native call (a C function called
through ctypes.PyDLL, an extension that does not release it) or a process stopped by a signal
reports nothing more, and the last place it said stands, however old. The launcher is the
workers' ancestor, which Linux's default ptrace policy (Yama scope 1) lets read them, so when a
rank's reports have stopped it asks py-spy (a binary wheel on PyPI) for every thread's stack:
which line the main thread is at, whether it runs, and which thread holds the GIL. py-spy reads
the process's memory without pausing it (`--nonblocking`: a stopped process is read too) and needs
no GIL. Where ptrace is refused
(Yama scope 2 or 3, a container without CAP_SYS_PTRACE) or py-spy is missing, the read says why
and the diagnosis keeps the rank's last report, saying how old it is.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

from gradsync.callsite import is_user_file, short_path

READ_TIMEOUT_S = 10.0  # a dump of a live process takes well under a second


@dataclass(frozen=True)
class OutsideRead:
    """What py-spy read of one rank: its main thread's stack (outermost first, 'file:line in
    function' as the rank's own snapshots write it) and innermost user line, whether that thread
    was running, and which thread holds the GIL (None: none does)."""

    at: float  # time.time() of the read
    stack: list[str]
    location: str | None
    running: bool
    gil: str | None  # "the main thread", or "thread NAME"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def py_spy() -> str | None:
    """The py-spy executable: beside this Python (a virtual environment's bin), else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def read_from_outside(pid: int, working_dir: str | None = None, timeout_s: float = READ_TIMEOUT_S) -> OutsideRead | str:
    """The rank's stacks read by py-spy, or why they could not be read (in words)."""
    executable = py_spy()
    if executable is None:
        return "py-spy is not installed (pip install py-spy)"
    try:
        # --nonblocking: read the memory without pausing the rank (which also reads a stopped one).
        done = subprocess.run([executable, "dump", "--pid", str(pid), "--json", "--nonblocking"], capture_output=True,
                              text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"py-spy did not answer ({type(error).__name__})"
    if done.returncode != 0:
        said = (done.stderr.strip() or done.stdout.strip() or f"exit code {done.returncode}").splitlines()[0]
        return f"py-spy could not read it: {said[:200]}"
    try:
        threads = json.loads(done.stdout)
    except json.JSONDecodeError:
        return "py-spy's answer was not JSON"
    return parse_dump(threads, pid, working_dir, time.time())


def parse_dump(threads: list[dict[str, Any]], pid: int, working_dir: str | None, at: float) -> OutsideRead | str:
    """py-spy's JSON dump (one entry per thread, frames innermost first) as an OutsideRead."""
    if not threads:
        return "py-spy read no thread"
    main = next((t for t in threads if t.get("os_thread_id") == pid), threads[0])
    frames = main.get("frames") or []
    stack = [f"{short_path(f['filename'], working_dir)}:{f['line']} in {f['name']}" for f in reversed(frames)]
    user = next((f for f in frames if is_user_file(f["filename"])), None)
    holder = next((t for t in threads if t.get("owns_gil")), None)
    gil = None if holder is None else "the main thread" if holder is main else f"thread {holder.get('thread_name') or holder.get('os_thread_id')}"
    return OutsideRead(at, stack, None if user is None else f"{short_path(user['filename'], working_dir)}:{user['line']}",
                       bool(main.get("active")), gil)


CHILDREN_READ = 8  # a rank's child processes read at most (a DataLoader's workers)


def read_children(pid: int, working_dir: str | None = None) -> list[dict[str, Any]]:
    """Each child process of `pid` (its DataLoader's workers, say) read from outside: its pid, the
    user's line its main thread is at and whether it runs, or why it could not be read."""
    try:
        children = psutil.Process(pid).children()[:CHILDREN_READ]
    except psutil.Error:
        return []
    found = []
    for child in children:
        read = read_from_outside(child.pid, working_dir)
        if isinstance(read, str):
            found.append({"pid": child.pid, "failed": read})
        else:
            found.append({"pid": child.pid, "location": read.location, "running": read.running})
    return found


def with_outside_read(snapshot: dict[str, Any], silent_s: float, running_state: str, idle_state: str) -> dict[str, Any]:
    """`snapshot` of a rank whose reports stopped `silent_s` ago, read from outside: its stack,
    line and activity (`running_state` or `idle_state`) replaced by what py-spy read, kept as
    "outside_read"; where the read fails, the snapshot as it was with why ("outside_read_failed")."""
    read = read_from_outside(snapshot["pid"], snapshot.get("cwd"))
    if isinstance(read, str):
        return {**snapshot, "outside_read_failed": read, "silent_s": round(silent_s, 1)}
    activity = {**(snapshot.get("activity") or {}), "state": running_state if read.running else idle_state, "position": None}
    return {**snapshot, "stack": read.stack, "location": read.location or snapshot.get("location"),
            "activity": activity, "outside_read": read.as_dict(), "silent_s": round(silent_s, 1)}
