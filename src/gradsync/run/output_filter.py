"""The small process that sorts a worker's native output: backend log lines to the rank's log only.

Under `gradsync run`, what native code in a worker writes to its stdout and stderr (file
descriptors 1 and 2) comes through two pipes to this process, which appends every byte to the
rank's log file and passes the rest on to the console, leaving out the log lines of the
libraries underneath (c10/glog, Gloo, NCCL, the profiler's kineto): a user sees their script's
output and gradsync's lines, and the backend's chatter waits in the log the diagnosis points to.
Lines are recognised by the header those loggers put in front of every message (level, time,
process, source file and line), never by what the message says.

It runs as a separate process, not a thread of the worker, so that what a worker writes just
before it dies (an abort message, a segfault report) is still drained from the pipe. It imports
only the standard library (it starts in ~20 ms and is run by path with `python -I`).

    python -I output_filter.py LOG_FILE SHOW_ALL STDOUT_PIPE STDERR_PIPE CONSOLE_OUT CONSOLE_ERR
"""

from __future__ import annotations

import os
import re
import select
import signal
import sys

BACKEND_LOG_LINE = re.compile(
    rb"^(?:\[rank\d+\]:)?(?:"
    # c10 / glog: "[W1201 07:06:12.149000 2518 ProcessGroupGloo.cpp:123] ..." (brackets optional)
    rb"\[?[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]"
    # kineto: "USDT:2026-12-01 07:04:19 2381:2381 SyncActivityProfilerHandler.cpp:52] ..."
    rb"|(?:VERBOSE|INFO|WARNING|ERROR|STAGE|USDT):\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \S+:\d+\]"
    # NCCL: "host:2518:2601 [0] NCCL INFO ..."
    rb"|\S+:\d+:\d+ \[\d+\] NCCL (?:INFO|WARN|TRACE|ERROR)"
    rb")"
)
IDLE_FLUSH_S = 0.2  # a partial line (a prompt, a progress bar) is passed on after this long


def is_backend_log_line(line: bytes) -> bool:
    return BACKEND_LOG_LINE.match(line) is not None


def split_lines(pending: bytes) -> tuple[list[bytes], bytes]:
    """Complete lines (each with its "\\n" or "\\r": progress bars redraw with "\\r") and the rest."""
    lines = []
    start = 0
    for match in re.finditer(rb"\r\n|\n|\r", pending):
        lines.append(pending[start : match.end()])
        start = match.end()
    return lines, pending[start:]


def _write_all(fd: int, data: bytes) -> None:
    while data:
        try:
            data = data[os.write(fd, data) :]
        except OSError:
            return  # the console went away (a closed terminal): the log still has everything


def main(argv: list[str]) -> None:
    log_path, show_all, *numbers = argv
    out_pipe, err_pipe, console_out, console_err = (int(n) for n in numbers)
    for name in ("SIGINT", "SIGTERM", "SIGHUP"):
        # Drain until the worker and every process holding the pipes are gone, however they ended.
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    console = {out_pipe: console_out, err_pipe: console_err}
    pending = {out_pipe: b"", err_pipe: b""}
    # Whether the line being passed on is a backend's, decided by its start: a partial line
    # passed on after a pause keeps that verdict for the rest of it.
    backend_line: dict[int, bool | None] = {out_pipe: None, err_pipe: None}
    open_pipes = [out_pipe, err_pipe]

    def emit(pipe: int, chunk: bytes) -> None:
        if backend_line[pipe] is None:
            backend_line[pipe] = is_backend_log_line(chunk)
        _write_all(log, chunk)
        if show_all == "1" or not backend_line[pipe]:
            _write_all(console[pipe], chunk)
        if chunk.endswith((b"\n", b"\r")):
            backend_line[pipe] = None

    while open_pipes:
        ready, _, _ = select.select(open_pipes, [], [], IDLE_FLUSH_S)
        if not ready:
            for pipe in open_pipes:
                if pending[pipe]:
                    emit(pipe, pending[pipe])
                    pending[pipe] = b""
            continue
        for pipe in ready:
            data = os.read(pipe, 65536)
            if not data:
                open_pipes.remove(pipe)
                if pending[pipe]:
                    emit(pipe, pending[pipe])
                continue
            lines, pending[pipe] = split_lines(pending[pipe] + data)
            for line in lines:
                emit(pipe, line)


if __name__ == "__main__":
    main(sys.argv[1:])
