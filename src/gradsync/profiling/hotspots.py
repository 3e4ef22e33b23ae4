"""Which lines of the user's code a profiled step's time goes to: the training thread's stack, sampled.

The profiler's trace says how much of a step is data loading, forward, backward, communication,
the optimizer, or none of these ("other": Python between the phases, a sleep, logging, a
`.item()` that waits for the device). It cannot say which line that last part is: its own
stacks (`with_stack`) name the function a call was made from by the function's first line, and
cost every operator a stack walk. So while a ProfileWindow records, a thread of gradsync's
samples the training thread's stack every few milliseconds (`sys._current_frames`) and charges
each interval to the innermost line of the user's own files, with what that line was doing:

- "own": the user's code itself (Python, a sleep, a print or logging call, a C call such as
  `.item()`), with no torch or gradsync frame inside it;
- "data": a torch DataLoader frame is on the stack (the batch being fetched or collated, the
  user's `collate_fn` or dataset included);
- "framework": torch's or gradsync's work called from that line (forward, backward, the
  optimizer, a collective).

The report names the top lines of the first two kinds when "other" or data loading take a large
share of the step (gradsync.report.advice). The sampler never raises into the program it runs in:
a failure ends the sampling and leaves the lines it had.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
import types
from dataclasses import asdict, dataclass

import torch

from gradsync.callsite import OWN, file_kind, short_path, user_frame

SAMPLE_EVERY_S = 0.005  # 200 samples a second: a 50 ms sleep gets ten, and the walk costs ~1% of a core
MOST_KEPT = 10  # lines kept per rank, most time first
LEAST_SHARE = 0.01  # lines with less of the sampled time are left out
KINDS = ("own", "data", "framework")

_TORCH = os.path.realpath(os.path.dirname(torch.__file__)) + os.sep
_TORCH_DATA = os.path.join(_TORCH, "utils", "data") + os.sep
_GRADSYNC = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep


@dataclass(frozen=True)
class Hotspot:
    """One line of the user's code and the share of the sampled wall time spent there."""

    where: str  # file:line, relative to the working folder when under it
    function: str
    kind: str  # one of KINDS
    share: float

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


class _FrameKinds:
    """Per code object (cached: the same few functions are sampled all the time): whether it is
    the user's, torch's DataLoader, or torch's or gradsync's work."""

    def __init__(self) -> None:
        self._cache: dict[types.CodeType, str] = {}

    def __call__(self, code: types.CodeType) -> str:
        kind = self._cache.get(code)
        if kind is None:
            path = os.path.realpath(code.co_filename)
            if path.startswith(_TORCH_DATA):
                kind = "data"
            elif path.startswith((_TORCH, _GRADSYNC)):
                kind = "framework"
            else:
                kind = "user" if file_kind(code.co_filename) == OWN else "other"
            self._cache[code] = kind
        return kind


def classify(frame: types.FrameType | None, kinds: _FrameKinds | None = None) -> tuple[str, str, str] | None:
    """(file:line, function, kind) of a stack's innermost user line, None without one."""
    kinds = kinds or _FrameKinds()
    line = user_frame(frame)
    if line is None:
        return None
    inside = data = reached = False
    walker = frame
    while walker is not None:  # innermost first: frames met before `line` were called from it
        reached = reached or walker is line
        kind = kinds(walker.f_code)
        if kind == "data":
            data = True
        elif kind == "framework" and not reached:
            inside = True
        walker = walker.f_back
    where = f"{short_path(line.f_code.co_filename)}:{line.f_lineno}"
    return where, line.f_code.co_name, "data" if data else "framework" if inside else "own"


class StackSampler:
    """Samples one thread's stack until stopped; `stop()` returns where the time went."""

    def __init__(self, thread_id: int | None = None, every_s: float = SAMPLE_EVERY_S) -> None:
        """`thread_id`: the thread to sample (default: the one constructing the sampler)."""
        self.thread_id = threading.get_ident() if thread_id is None else thread_id
        self.every_s = every_s
        self._seconds: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self._sampled_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gradsync-stack-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> list[Hotspot]:
        """Stop sampling; the lines with at least LEAST_SHARE of the time, most first (MOST_KEPT)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=1.0)
        return hotspots(dict(self._seconds), self._sampled_s)

    def _run(self) -> None:
        kinds = _FrameKinds()
        last = time.perf_counter()
        try:
            while not self._stop.wait(self.every_s):
                frame = sys._current_frames().get(self.thread_id)
                now = time.perf_counter()
                elapsed, last = now - last, now
                if frame is None:  # the thread ended
                    return
                self._sampled_s += elapsed
                found = classify(frame, kinds)
                del frame
                if found is not None:
                    self._seconds[found] += elapsed
        except BaseException:  # never into the program: what was sampled stays
            return


def hotspots(seconds: dict[tuple[str, str, str], float], sampled_s: float) -> list[Hotspot]:
    """Seconds per (where, function, kind) as shares of `sampled_s`, the largest MOST_KEPT above LEAST_SHARE."""
    if sampled_s <= 0:
        return []
    ranked = sorted(seconds.items(), key=lambda item: item[1], reverse=True)
    return [Hotspot(where, function, kind, round(spent / sampled_s, 4))
            for (where, function, kind), spent in ranked[:MOST_KEPT] if spent / sampled_s >= LEAST_SHARE]
