"""Finding the user's line: the innermost frame that is not torch, gradsync or the standard library.

A diagnosis is only useful if it points at the line the user wrote ("train.py:42"), not at
torch/distributed/distributed_c10d.py. Collectives are recorded on hot paths, so the
per-code-object verdict is cached.
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
import threading
import types

import torch

_LIBRARY_DIRS = tuple(
    os.path.realpath(path) + os.sep
    for path in (
        os.path.dirname(torch.__file__),
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # gradsync's own folder
        sysconfig.get_paths()["stdlib"],
        sysconfig.get_paths()["platstdlib"],
    )
)
_is_user_code: dict[types.CodeType, bool] = {}


def is_user_file(filename: str) -> bool:
    """True for files the user wrote: not torch, gradsync, the standard library or a frozen module."""
    if filename.startswith("<"):
        return False
    return not os.path.realpath(filename).startswith(_LIBRARY_DIRS)


def _user_code(code: types.CodeType) -> bool:
    verdict = _is_user_code.get(code)
    if verdict is None:
        verdict = _is_user_code[code] = is_user_file(code.co_filename)
    return verdict


def short_path(filename: str) -> str:
    """A path relative to the working directory when the file is under it (what the user typed)."""
    return _short_path(filename, os.getcwd())


@functools.lru_cache(maxsize=4096)
def _short_path(filename: str, working_dir: str) -> str:
    # Cached: every recorded collective names its call site, and relpath costs more than recording.
    try:
        relative = os.path.relpath(filename, working_dir)
    except ValueError:
        return filename
    return filename if relative.startswith("..") else relative


def user_frame(frame: types.FrameType | None) -> types.FrameType | None:
    """The innermost user frame at or above `frame`, or None."""
    while frame is not None:
        if _user_code(frame.f_code):
            return frame
        frame = frame.f_back
    return None


_locations: dict[tuple[types.CodeType, int], str] = {}


def location(frame: types.FrameType | None) -> str | None:
    if frame is None:
        return None
    # Cached per line: a training loop names the same few lines every step.
    key = (frame.f_code, frame.f_lineno)
    text = _locations.get(key)
    if text is None:
        text = _locations[key] = f"{short_path(frame.f_code.co_filename)}:{frame.f_lineno}"
    return text


def caller_location() -> str | None:
    """file:line of the user code that (directly or through torch) called the current function.

    Gradient buckets of a CUDA backward are reduced on autograd's device threads, whose stacks
    hold no user frame; the main thread's stack (inside `loss.backward()`) is the answer then.
    """
    found = user_frame(sys._getframe(1))
    if found is None and threading.current_thread() is not threading.main_thread():
        found = user_frame(sys._current_frames().get(threading.main_thread().ident))
    return location(found)


def stack_summary(frame: types.FrameType | None, limit: int = 40) -> list[str]:
    """Outermost-first 'file:line in function' lines of a stack, for the diagnosis."""
    lines = []
    while frame is not None and len(lines) < limit:
        code = frame.f_code
        lines.append(f"{short_path(code.co_filename)}:{frame.f_lineno} in {code.co_name}")
        frame = frame.f_back
    lines.reverse()
    return lines


def innermost_user_location(stack: list[tuple[str, int]]) -> str | None:
    """From (filename, line) pairs listed outermost first (a traceback), the user's innermost line."""
    for filename, line in reversed(stack):
        if is_user_file(filename):
            return f"{short_path(filename)}:{line}"
    return None
