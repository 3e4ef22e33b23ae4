"""How a rank's process ends once its script has: as CPython ends it, and what holds it meanwhile.

CPython ends a script in this order: threading's own exit callbacks (a ThreadPoolExecutor asks its
workers to stop), then it joins every non-daemon thread, then it runs the atexit handlers. The
worker ends the process itself (gradsync.distributed.end_process: atexit handlers, then
os._exit), so it must join the script's threads first, as CPython would: a thread still writing a
checkpoint would otherwise be cut off, and a thread that only an atexit handler stops would hang
the job under torchrun and never under `gradsync run`.

While the join waits, the rank's snapshots say so (`ending`: how the script ended, and each
non-daemon thread that holds the process, with the line it is at and the line that started it),
so that a process that never exits is named at those threads, not taken for a rank that stalled
inside its script. A script's own ending is recorded where it was made: the line of a `sys.exit`,
and an `os._exit` from any thread (HardExits), which would otherwise end the rank without a word.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
import traceback
import weakref
from typing import Any, NoReturn

from gradsync.callsite import innermost_user_location, location, stack_summary, user_frame
from gradsync.run.harmless import Bookkeeping

HELD_FRAMES = 8  # innermost frames kept of each holding thread: what it waits on (analysis.working.waits_on)


class ThreadSites:
    """Where the script created and started each thread: its innermost user line at
    `Thread(...)` (where `daemon=` is decided) and at `Thread.start()`, kept in weak maps keyed by
    the thread (nothing is added to the user's thread objects)."""

    def __init__(self, bookkeeping: Bookkeeping) -> None:
        self.bookkeeping = bookkeeping
        self._created: weakref.WeakKeyDictionary[threading.Thread, str] = weakref.WeakKeyDictionary()
        self._started: weakref.WeakKeyDictionary[threading.Thread, str] = weakref.WeakKeyDictionary()

    def install(self) -> None:
        threading.Thread.__init__ = self._noting(threading.Thread.__init__, self._created)  # type: ignore[method-assign]
        threading.Thread.start = self._noting(threading.Thread.start, self._started)  # type: ignore[method-assign]

    def _noting(self, method: Any, sites: weakref.WeakKeyDictionary) -> Any:
        """`method` as it is, then the caller's user line noted in `sites` (never raising)."""
        bookkeeping = self.bookkeeping

        @functools.wraps(method)
        def noting_where(thread: threading.Thread, *args: Any, **kwargs: Any) -> Any:
            result = method(thread, *args, **kwargs)
            with bookkeeping:
                site = location(user_frame(sys._getframe(1)))
                if site is not None:
                    sites[thread] = site
            return result

        return noting_where

    def created(self, thread: threading.Thread) -> str | None:
        return self._created.get(thread)

    def started(self, thread: threading.Thread) -> str | None:
        return self._started.get(thread)


def holding_threads(sites: ThreadSites | None) -> list[dict[str, Any]]:
    """The non-daemon threads but the main one still alive: what CPython's exit joins. Each with
    its name, the user's line it is at (None: none of its frames is the user's), the lines that
    created and started it, and its innermost frames."""
    frames = sys._current_frames()
    held = []
    for thread in threading.enumerate():
        if thread is threading.main_thread() or thread.daemon or not thread.is_alive():
            continue
        frame = frames.get(thread.ident) if thread.ident is not None else None
        held.append({
            "thread": thread.name,
            "at": location(user_frame(frame)),
            "created_at": sites.created(thread) if sites is not None else None,
            "started_at": sites.started(thread) if sites is not None else None,
            "stack": stack_summary(frame, limit=HELD_FRAMES),
        })
    return held


def join_script_threads() -> None:
    """What CPython does between a script's end and its atexit handlers: threading's exit
    callbacks, then join every non-daemon thread (threading._shutdown, which the interpreter calls
    at that point; only where it is there and only from the main thread)."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is None or threading.current_thread() is not threading.main_thread():
        return
    shutdown()


def exit_site(error: BaseException) -> str | None:
    """The user's line a `sys.exit(...)` (a SystemExit) was raised at: the innermost frame of the
    user's files in its traceback; None when none is (raised by a library alone)."""
    return innermost_user_location([(frame.filename, frame.lineno) for frame in traceback.extract_tb(error.__traceback__)])


class HardExits:
    """A script's `os._exit(n)` (a watchdog thread giving up on a slow rank, a library's own timeout)
    ends the process on the spot: no exception, no exit handlers, so the rank would leave no exit
    record and be read as killed by something unknown. Installed in the worker, os._exit first
    hands `record` the ending (code, the user's line, the thread), then ends the process as it
    would have. Only in the worker's own process (a forked DataLoader worker ends by os._exit too,
    and must not write its parent's record), once, and for the arguments os._exit accepts.
    gradsync's own endings use the original (gradsync.distributed.exit_now)."""

    def __init__(self, record: Any, bookkeeping: Bookkeeping) -> None:
        self.record = record  # called with the outcome, {"status", "code", "how", "location", "thread", "time"}
        self.bookkeeping = bookkeeping
        self.pid = os.getpid()
        self.original = os._exit
        self.recorded = False

    def install(self) -> None:
        os._exit = self.exit

    def exit(self, code: int) -> NoReturn:
        if isinstance(code, int) and os.getpid() == self.pid and not self.recorded:
            self.recorded = True
            with self.bookkeeping:
                thread = threading.current_thread()
                self.record({"status": "finished" if code == 0 else "exit_code", "code": code, "how": "os._exit",
                             "location": location(user_frame(sys._getframe(1))),
                             "thread": None if thread is threading.main_thread() else thread.name, "time": time.time()})
        self.original(code)
