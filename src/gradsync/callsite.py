"""Finding the user's line: the innermost frame of the user's own files (else of an installed package).

A diagnosis is only useful if it points at the line the user wrote ("train.py:42"), not at
torch/distributed/distributed_c10d.py. Collectives are recorded on hot paths, so the
per-code-object verdict is cached.
"""

from __future__ import annotations

import functools
import os
import site
import sys
import sysconfig
import threading
import types

import torch

def _folders(*paths: str) -> tuple[str, ...]:
    return tuple(os.path.realpath(path) + os.sep for path in paths)


_GRADSYNC_AND_TORCH = _folders(os.path.dirname(torch.__file__), os.path.dirname(os.path.abspath(__file__)))
_STDLIB = _folders(sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"])
# Installed packages (Lightning, transformers, torchmetrics...): the user's line is preferred, and
# one of theirs is taken only when no frame of the user's own files is on the stack.
# Checked before the standard library: a virtual environment's site-packages lies inside its lib/pythonX.Y.
_INSTALLED = _folders(*{sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages(), site.getusersitepackages()})
OWN, INSTALLED, NEVER = 0, 1, 2  # whose file a frame runs: the user's, an installed package's, torch/gradsync/stdlib
_file_kinds: dict[types.CodeType, int] = {}


def file_kind(filename: str) -> int:
    """OWN for files the user wrote, INSTALLED for other installed packages, NEVER for torch,
    gradsync, the standard library and frozen modules (never the answer to "which line")."""
    if filename.startswith("<"):
        return NEVER
    path = os.path.realpath(filename)
    if path.startswith(_GRADSYNC_AND_TORCH):
        return NEVER
    if path.startswith(_INSTALLED):
        return INSTALLED
    return NEVER if path.startswith(_STDLIB) else OWN


def is_user_file(filename: str) -> bool:
    """True for files the user wrote: not torch, gradsync, the standard library or an installed package."""
    return file_kind(filename) == OWN


def _kind(code: types.CodeType) -> int:
    verdict = _file_kinds.get(code)
    if verdict is None:
        verdict = _file_kinds[code] = file_kind(code.co_filename)
    return verdict


def short_path(filename: str, working_dir: str | None = None) -> str:
    """A path relative to the working directory (this process's, or `working_dir`: another
    process's) when the file is under it (what the user typed)."""
    return _short_path(filename, working_dir or os.getcwd())


@functools.lru_cache(maxsize=4096)
def _short_path(filename: str, working_dir: str) -> str:
    # Cached: every recorded collective names its call site, and relpath costs more than recording.
    try:
        relative = os.path.relpath(filename, working_dir)
    except ValueError:
        return filename
    return filename if relative.startswith("..") else relative


def user_frame(frame: types.FrameType | None) -> types.FrameType | None:
    """The innermost frame of the user's own files at or above `frame`; failing that, the
    innermost frame of an installed package; else None."""
    installed = None
    while frame is not None:
        kind = _kind(frame.f_code)
        if kind == OWN:
            return frame
        if kind == INSTALLED and installed is None:
            installed = frame
        frame = frame.f_back
    return installed


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


def entry_site(obj: object) -> str | None:
    """The user's line that called into `obj` from outside it: the caller of the outermost frame
    running one of its methods (`model.module.compute_loss(batch)`, whose method then calls the
    forward; a DataLoader subclass whose `__init__` calls the base's); else the innermost user
    frame."""
    frame, entered = sys._getframe(1), None
    while frame is not None:
        if frame.f_locals.get("self") is obj:
            entered = frame
        frame = frame.f_back
    caller = entered.f_back if entered is not None else None
    if caller is not None and file_kind(caller.f_code.co_filename) == OWN:
        return location(caller)
    return location(user_frame(sys._getframe(1)))


def user_frames(frame: types.FrameType | None) -> list[tuple[str, str, int, int, int]]:
    """The frames of the user's own files on a stack (failing those, of installed packages),
    outermost first, as (file, function, the function's first line, current line, current
    instruction's offset)."""
    own: list[tuple[str, str, int, int, int]] = []
    installed: list[tuple[str, str, int, int, int]] = []
    while frame is not None:
        code = frame.f_code
        kind = _kind(code)
        if kind != NEVER:
            (own if kind == OWN else installed).append((code.co_filename, code.co_name, code.co_firstlineno, frame.f_lineno, frame.f_lasti))
        frame = frame.f_back
    chosen = own or installed
    chosen.reverse()
    return chosen


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
    installed = None
    for filename, line in reversed(stack):
        kind = file_kind(filename)
        if kind == OWN:
            return f"{short_path(filename)}:{line}"
        if kind == INSTALLED and installed is None:
            installed = f"{short_path(filename)}:{line}"
    return installed
