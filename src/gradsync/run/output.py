"""Where a worker's output goes under `gradsync run`: the console for people, the rank's log for all.

- Python's own streams (`print`, logging, warnings, gradsync's lines) keep writing to the
  console, and a copy of everything goes to the rank's log file `workers/attemptN/rankR.log`.
- File descriptors 1 and 2, where native code (Gloo, NCCL, c10, the profiler) and child
  processes write, go through `output_filter`, a small process that appends everything to the
  same log and leaves the backend libraries' own log lines off the console
  (`gradsync run --show-backend-logs` keeps them).
- An uncaught exception's traceback goes to the log only; the diagnosis prints the traceback of
  the rank that failed first, once, instead of every rank's (consequences included) on top of
  one another.

Python's streams are re-opened on copies of the console's descriptors, so they stay what they
were (a terminal keeps its progress bars and line buffering).
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path
from typing import TextIO

FILTER_SCRIPT = Path(__file__).with_name("output_filter.py")
FILTER_EXIT_WAIT_S = 1.0  # at exit, time given to the filter to pass on the last lines


class _Tee(io.RawIOBase):
    """Bytes written to the console descriptor and appended to the log."""

    def __init__(self, console_fd: int, log_fd: int) -> None:
        self.console_fd = console_fd
        self.log_fd = log_fd

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return os.isatty(self.console_fd)

    def fileno(self) -> int:
        return self.console_fd

    def write(self, data: bytes) -> int:  # type: ignore[override]
        view = memoryview(data)
        for fd in (self.console_fd, self.log_fd):
            rest = view
            while rest:
                try:
                    rest = rest[os.write(fd, rest) :]
                except OSError:
                    break  # a vanished console must not stop training; the log keeps going
        return len(view)


def _reopened(stream: TextIO, console_fd: int, log_fd: int) -> TextIO:
    # Unbuffered, as torchrun starts its workers (python -u): a line printed before a hang must
    # be on the console and in the log when the stalled job is stopped.
    stream.flush()
    return io.TextIOWrapper(
        _Tee(console_fd, log_fd),  # type: ignore[arg-type]
        encoding=stream.encoding,
        errors=stream.errors,
        line_buffering=True,
        write_through=True,
    )


class WorkerOutput:
    """The routing above, for one worker process; `close()` before the process ends."""

    def __init__(self, log_path: Path, show_backend_logs: bool) -> None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        self.log_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        console_out, console_err = os.dup(1), os.dup(2)
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        fds = (out_read, err_read, console_out, console_err)
        self.filter = subprocess.Popen(
            [sys.executable, "-I", str(FILTER_SCRIPT), str(log_path), "1" if show_backend_logs else "0", *map(str, fds)],
            pass_fds=fds,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # the launcher's stop signals the worker's group: the filter keeps draining
        )
        os.dup2(out_write, 1)
        os.dup2(err_write, 2)
        for fd in (out_read, err_read, out_write, err_write):
            os.close(fd)
        sys.stdout = sys.__stdout__ = _reopened(sys.stdout, console_out, self.log_fd)
        sys.stderr = sys.__stderr__ = _reopened(sys.stderr, console_err, self.log_fd)

    def log_only(self, text: str) -> None:
        """Append `text` to the rank's log without showing it."""
        sys.stdout.flush()
        sys.stderr.flush()
        os.write(self.log_fd, text.encode(errors="replace"))

    def close(self) -> None:
        """Let the filter pass on the last native lines before the process ends."""
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        os.close(devnull)
        try:
            self.filter.wait(FILTER_EXIT_WAIT_S)  # children still holding the pipes keep it running
        except subprocess.TimeoutExpired:
            pass
