"""Where each profiled training step's time went, computed from a Chrome trace of torch.profiler.

The training thread is the thread that holds the step ranges (`gradsync:step#N` from
`ProfileWindow`, else torch's `ProfilerStep#N`). Each step's wall time on that thread is cut
into disjoint pieces, each labelled with one part, so the parts add up to the step time by
construction:

* exposed_comm: the thread waits, a gradient collective is in flight and no backward compute
  runs (the exact rule is below);
* otherwise the innermost phase range covering the moment: data, forward, backward or
  optimizer. A phase comes from the `gradsync:<phase>` annotations when the step has any for
  it, else from torch's own names, so traces of unmodified scripts work too: data is
  `enumerate(DataLoader)#...`, optimizer is `Optimizer.step#...` and `Optimizer.zero_grad#...`,
  a backward pass is a run of the autograd engine's `evaluate_function` events extended over
  DDP's wait for its collectives and its `reducer::copy_bucket_to_grad` work, and forward runs
  from `DistributedDataParallel.forward` (or, without DDP, the first other operator) up to the
  backward it feeds;
* other: whatever is left (Python between phases, logging, idle).

Gradient communication is every collective issued during a backward pass: `gloo:*` ranges,
which Gloo records on its worker threads for as long as the collective runs (a late peer
included), cut at the end of their backward pass, which cannot end before them; and NCCL
kernels on the GPU timeline. `nccl:*` CPU ranges and `c10d::*` operators are the calls that
issue a collective, not its run, so they are not communication time (though a thread stuck in
one waits, see below). comm_s is the length of the union of a step's gradient collectives,
hidden_comm_s the part of it that overlaps backward compute, overlap_ratio their quotient.

Backward compute is, on the CPU, the span from the first to the last autograd function of a
pass (the engine keeps the thread busy throughout) less the `c10d::*` calls in it. When the
trace has GPU kernels it is the union of the non-communication kernels launched during the
pass instead, because the GPU can idle between them and NCCL kernels share its timeline.

Exposed communication is waiting ∩ gradient communication − backward compute. The thread
waits (a) in a backward pass after its last autograd function: DDP's reducer blocks there
until every bucket's collective is done, and nothing is recorded on the waiting thread; (b) in
`c10d::*` calls: on a busy CPU a DDP hook's `c10d::allreduce_` can hold the thread for as long
as the Gloo collective it issues runs (seen on 2 shared cores); (c) in CUDA synchronisations
(`cudaStreamSynchronize` and the like), where the CPU meets a GPU that is still reducing. On
CPU/Gloo every gradient collective runs inside its backward pass, so hidden + exposed = comm.

Tested on CPU/Gloo traces recorded by torch 2.13. The CUDA/NCCL rules (kernels matched to their
launches by `correlation`, NCCL kernels as communication, CUDA syncs as waits) follow Kineto's
trace format but were only checked on a hand-built trace, never on one from a real GPU.
"""

from __future__ import annotations

import json
import re
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from itertools import pairwise
from pathlib import Path
from typing import Any

from gradsync.errors import ConfigError

PHASES = ("data", "forward", "backward", "optimizer")
PHASE_ANNOTATION_PREFIX = "gradsync:"
STEP_ANNOTATION_PREFIX = "gradsync:step#"

_GRADSYNC_STEP = re.compile(r"gradsync:step#(\d+)")
_TORCH_STEP = re.compile(r"ProfilerStep#(\d+)")
_AUTOGRAD_FUNCTION_PREFIX = "autograd::engine::evaluate_function:"
_BUCKET_COPY = "reducer::copy_bucket_to_grad"
_DDP_FORWARD = "DistributedDataParallel.forward"
_TORCH_DATA_PREFIX = "enumerate(DataLoader)#"
_TORCH_OPTIMIZER_PREFIXES = ("Optimizer.step#", "Optimizer.zero_grad#")
_GLOO_PREFIX = "gloo:"
_COLLECTIVE_CALL_PREFIX = "c10d::"
_NCCL_KERNEL_PREFIX = "nccl"
_DEVICE_WAITS = frozenset(
    {"cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy"}
)

Interval = tuple[float, float]


@dataclass(frozen=True)
class StepTimes:
    """One step's time in seconds: data_s to other_s partition step_s; the comm fields overlap them."""

    # N of the step's range: the optimizer step (from 1) for gradsync:step#N, torch's count (from 0)
    # for ProfilerStep#N; None for the mean over steps.
    step: int | None
    step_s: float
    data_s: float
    forward_s: float
    backward_s: float
    exposed_comm_s: float
    optimizer_s: float
    other_s: float
    comm_s: float
    hidden_comm_s: float
    overlap_ratio: float | None  # None when the step had no gradient communication

    def parts(self) -> dict[str, float]:
        """The partition of step_s, in the order of a step."""
        return {name: getattr(self, f"{name}_s") for name in _PARTS}


_PARTS = ("data", "forward", "backward", "exposed_comm", "optimizer", "other")


@dataclass(frozen=True)
class StepBreakdown:
    """The profiled steps of one rank's trace and what the times were read from."""

    steps: tuple[StepTimes, ...]
    annotated_phases: tuple[str, ...]  # phases read from gradsync annotations; the rest from torch's names
    comm_source: str  # "gloo", "nccl", "gloo+nccl" or "none"

    @property
    def mean(self) -> StepTimes:
        count = len(self.steps)
        sums = {
            f.name: sum(getattr(s, f.name) for s in self.steps)
            for f in fields(StepTimes)
            if f.name.endswith("_s")
        }
        # The ratio of sums, not the mean of ratios: a step with little communication must not
        # weigh as much as one with a lot.
        ratio = sums["hidden_comm_s"] / sums["comm_s"] if sums["comm_s"] > 0 else None
        return StepTimes(
            step=None, overlap_ratio=ratio, **{name: total / count for name, total in sums.items()}
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": [asdict(s) for s in self.steps],
            "mean": asdict(self.mean),
            "annotated_phases": list(self.annotated_phases),
            "comm_source": self.comm_source,
        }


def analyze_trace(trace: str | Path | Mapping[str, Any]) -> StepBreakdown:
    """Break down every step of a Chrome trace (a path to torch's export, or its parsed JSON)."""
    if not isinstance(trace, Mapping):
        trace = json.loads(Path(trace).read_text())
    parsed = _Trace(
        [_Event.from_json(e) for e in trace.get("traceEvents", ()) if e.get("ph") == "X" and "dur" in e]
    )
    steps = tuple(_step_times(number, window, parsed) for number, window in parsed.steps)
    annotated = tuple(p for p in PHASES if any(e.name == PHASE_ANNOTATION_PREFIX + p for e in parsed.thread))
    return StepBreakdown(steps=steps, annotated_phases=annotated, comm_source=parsed.comm_source)


def format_breakdown(breakdown: StepBreakdown) -> str:
    """A short table: one row per step in milliseconds, the mean, and each part's share of it."""
    header = ("step", "step ms", *(p.replace("_", " ") for p in _PARTS), "comm ms", "overlap")
    rows = [header]
    for times in (*breakdown.steps, breakdown.mean):
        ratio = "-" if times.overlap_ratio is None else f"{times.overlap_ratio:.0%}"
        label = "mean" if times.step is None else str(times.step)
        rows.append(
            (label, *(f"{v * 1e3:.2f}" for v in (times.step_s, *times.parts().values(), times.comm_s)), ratio)
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    mean = breakdown.mean
    if mean.step_s > 0:
        lines.append(
            "share: "
            + ", ".join(f"{n.replace('_', ' ')} {v / mean.step_s:.0%}" for n, v in mean.parts().items())
        )
    annotated = breakdown.annotated_phases
    if not annotated:
        source = "phases from torch's event names"
    elif len(annotated) == len(PHASES):
        source = "phases from gradsync annotations"
    else:
        source = (
            f"phases from gradsync annotations ({', '.join(annotated)}), the rest from torch's event names"
        )
    lines.append(f"{source}; communication events: {breakdown.comm_source}")
    return "\n".join(lines)


@dataclass(frozen=True)
class _Event:
    name: str
    category: str
    pid: Any
    tid: Any
    start: float
    end: float
    correlation: int | None

    @classmethod
    def from_json(cls, event: Mapping[str, Any]) -> _Event:
        start = float(event["ts"])
        correlation = (event.get("args") or {}).get("correlation")
        return cls(
            name=str(event.get("name", "")),
            category=str(event.get("cat", "")),
            pid=event.get("pid"),
            tid=event.get("tid"),
            start=start,
            end=start + float(event["dur"]),
            correlation=correlation if isinstance(correlation, int) else None,
        )

    @property
    def span(self) -> Interval:
        return (self.start, self.end)

    @property
    def is_kernel(self) -> bool:
        return self.category == "kernel"

    @property
    def is_nccl_kernel(self) -> bool:
        return self.is_kernel and self.name.lower().startswith(_NCCL_KERNEL_PREFIX)


class _Trace:
    """The events of one trace, sorted by start and indexed the ways the step analysis reads them."""

    def __init__(self, events: list[_Event]) -> None:
        events.sort(key=lambda e: (e.start, -e.end))
        step_events = _find_step_events(events)
        self.pid, tid = step_events[0][1].pid, step_events[0][1].tid
        self.steps = [(number, e.span) for number, e in step_events if (e.pid, e.tid) == (self.pid, tid)]
        self.thread = [e for e in events if e.pid == self.pid and e.tid == tid]
        self.thread_starts = [e.start for e in self.thread]
        process = [e for e in events if e.pid == self.pid]
        self.autograd = [e for e in process if e.name.startswith(_AUTOGRAD_FUNCTION_PREFIX)]
        self.bucket_copies = [e for e in process if _BUCKET_COPY in e.name]
        self.collective_calls = [e for e in process if e.name.startswith(_COLLECTIVE_CALL_PREFIX)]
        self.kernels = [e for e in events if e.is_kernel]
        # A kernel belongs to the phase that launched it: its launch (cudaLaunchKernel and the
        # like) carries the same correlation id on the CPU side.
        launches = {e.correlation: e.start for e in process if e.correlation is not None}
        self.issued = {k: launches.get(k.correlation, k.start) for k in self.kernels}
        gloo = [e for e in process if e.name.startswith(_GLOO_PREFIX)]
        nccl = [k for k in self.kernels if k.is_nccl_kernel]
        # Gloo starts a collective when a worker thread is free, possibly after backward's last
        # autograd function; it was issued by the c10d call before it (the queue is first in,
        # first out), which runs inside the backward that needs it.
        call_starts = [e.start for e in self.collective_calls]
        gloo_issued = [
            call_starts[i - 1] if (i := bisect_right(call_starts, e.start)) else e.start for e in gloo
        ]
        self.comm = list(zip(gloo_issued, gloo)) + [(self.issued[k], k) for k in nccl]
        self.compute_kernels = [k for k in self.kernels if not k.is_nccl_kernel]
        self.comm_source = (
            "+".join(name for name, found in (("gloo", gloo), ("nccl", nccl)) if found) or "none"
        )

    def on_thread(self, window: Interval) -> list[_Event]:
        return self.thread[
            bisect_left(self.thread_starts, window[0]) : bisect_left(self.thread_starts, window[1])
        ]


def _step_number(event: _Event) -> int | None:
    match = _GRADSYNC_STEP.fullmatch(event.name) or _TORCH_STEP.fullmatch(event.name)
    return int(match.group(1)) if match else None


def _find_step_events(events: list[_Event]) -> list[tuple[int, _Event]]:
    # ProfileWindow's ranges win over torch's: a script may also run torch's schedule, whose
    # ProfilerStep numbering need not match the optimizer steps.
    for pattern in (_GRADSYNC_STEP, _TORCH_STEP):
        steps = [(int(m.group(1)), e) for e in events if (m := pattern.fullmatch(e.name))]
        if steps:
            return steps
    raise ConfigError(
        "the trace has no step ranges (gradsync:step#N or ProfilerStep#N): record it with "
        "gradsync's ProfileWindow (--profile-steps 10:12), or with torch.profiler and a "
        "prof.step() call after each optimizer step."
    )


@dataclass(frozen=True)
class _BackwardPass:
    span: Interval
    compute_end: float  # end of the pass's last autograd function; the span's start when it had none
    compute: list[Interval]
    comm: list[Interval]


def _step_times(number: int, window: Interval, trace: _Trace) -> StepTimes:
    events = trace.on_thread(window)
    annotated = {p: [e.span for e in events if e.name == PHASE_ANNOTATION_PREFIX + p] for p in PHASES}
    data = annotated["data"] or [e.span for e in events if e.name.startswith(_TORCH_DATA_PREFIX)]
    optimizer = annotated["optimizer"] or [
        e.span for e in events if e.name.startswith(_TORCH_OPTIMIZER_PREFIXES)
    ]
    phase_starts = sorted(
        [s for s, _ in data + optimizer + annotated["forward"]]
        + [e.start for e in events if e.name == _DDP_FORWARD]
    )
    spans = annotated["backward"] or _derived_backward_spans(window, events, phase_starts, trace)
    passes = [_backward_pass(span, trace) for span in spans]
    forward = annotated["forward"] or _derived_forward_spans(window, events, data + optimizer, passes)

    comm = _union(iv for p in passes for iv in p.comm)
    compute = _union(iv for p in passes for iv in p.compute)
    waits = [(p.compute_end, p.span[1]) for p in passes]
    waits += [e.span for e in events if e.name in _DEVICE_WAITS]
    waits += [e.span for e in trace.collective_calls if window[0] <= e.start < window[1]]
    exposed = _subtract(_intersect(_union(waits), comm), compute)

    phase_ranges = [(s, e, "data") for s, e in data] + [(s, e, "optimizer") for s, e in optimizer]
    phase_ranges += [(s, e, "forward") for s, e in forward] + [
        (p.span[0], p.span[1], "backward") for p in passes
    ]
    parts = _partition(window, phase_ranges, exposed)

    comm_s = _length(comm) / 1e6
    hidden_s = _length(_intersect(comm, compute)) / 1e6
    return StepTimes(
        step=number,
        step_s=(window[1] - window[0]) / 1e6,
        **{f"{name}_s": parts[name] / 1e6 for name in _PARTS},
        comm_s=comm_s,
        hidden_comm_s=hidden_s,
        overlap_ratio=hidden_s / comm_s if comm_s > 0 else None,
    )


def _backward_pass(span: Interval, trace: _Trace) -> _BackwardPass:
    # Autograd may run on another thread than the training thread (CUDA's device threads), so
    # the pass is everything the process's engine did inside the span.
    functions = [e for e in trace.autograd if span[0] <= e.start < span[1]]
    compute_end = max((e.end for e in functions), default=span[0])
    if trace.kernels:
        compute = [k.span for k in trace.compute_kernels if span[0] <= trace.issued[k] <= span[1]]
    elif functions:
        calls = _union(e.span for e in trace.collective_calls if span[0] <= e.start < span[1])
        compute = _subtract([(functions[0].start, compute_end)], calls)
    else:
        compute = []
    # DDP's reducer lets backward end only once every bucket's collective has completed, so a
    # Gloo range outlasting the pass times its worker thread, not communication: it completes
    # the work, then closes the range, and on a busy CPU it can be descheduled in between (2 ms
    # seen on 2 shared cores). GPU kernels are not cut: the CPU does not wait for them there.
    comm = [
        e.span if e.is_kernel else (e.start, min(e.end, span[1]))
        for issued, e in trace.comm
        if span[0] <= issued <= span[1]
    ]
    return _BackwardPass(span=span, compute_end=compute_end, compute=compute, comm=comm)


def _derived_backward_spans(
    window: Interval, events: list[_Event], phase_starts: list[float], trace: _Trace
) -> list[Interval]:
    """Backward passes of an unannotated step: runs of autograd functions with no other work of
    the training thread between them, extended over DDP's wait for their collectives."""
    functions = [e for e in trace.autograd if window[0] <= e.start < window[1]]
    if not functions:
        return []
    backward_work = _union(
        e.span for e in events if e.name.startswith(_AUTOGRAD_FUNCTION_PREFIX) or _BUCKET_COPY in e.name
    )
    # Anything else the training thread starts outside the engine's and reducer's work, such as
    # the next micro-batch's forward, separates two backward passes.
    other_starts = [
        e.start
        for e in events
        if e.start > window[0] and not _covers(backward_work, e.start) and _step_number(e) is None
    ]
    runs: list[list[float]] = [[functions[0].start, functions[0].end]]
    for function in functions[1:]:
        current = runs[-1]
        if function.start > current[1] and bisect_right(other_starts, current[1]) < bisect_left(
            other_starts, function.start
        ):
            runs.append([function.start, function.end])
        else:
            current[1] = max(current[1], function.end)
    spans = []
    for i, (start, end) in enumerate(runs):
        # The pass is over by the next phase: the next forward or run, the optimizer, the data.
        later = phase_starts[bisect_right(phase_starts, end) :]
        limit = min([runs[i + 1][0] if i + 1 < len(runs) else window[1], *later[:1]])
        # After the last autograd function DDP's reducer waits for the pass's collectives, then
        # copies the reduced buckets into the gradients (unless they are views of the buckets);
        # until then the thread is still inside backward(). A Gloo range can outlast its
        # collective (see _backward_pass), which the limit bounds.
        waited = [e.end for issued, e in trace.comm if start <= issued <= end and not e.is_kernel]
        copies = [e.end for e in trace.bucket_copies if start <= e.start < limit]
        spans.append((start, min(max([end, *waited, *copies]), limit)))
    return spans


def _derived_forward_spans(
    window: Interval, events: list[_Event], data_and_optimizer: list[Interval], passes: list[_BackwardPass]
) -> list[Interval]:
    """Forward passes of an unannotated step: from the start of the forward to the backward it feeds."""
    spans = []
    previous_end = window[0]
    for backward in passes:
        before = [e for e in events if previous_end < e.start < backward.span[0]]
        ddp = [e.start for e in before if e.name == _DDP_FORWARD]
        # Without DDP's range, the forward starts with the first operator that is neither data
        # loading nor the optimizer: a zero_grad before the forward does not start it.
        others = [e.start for e in before if not any(s <= e.start <= t for s, t in data_and_optimizer)]
        start = (ddp or others or [None])[0]
        if start is not None:
            spans.append((start, backward.span[0]))
        previous_end = backward.span[1]
    return spans


def _partition(
    window: Interval, phase_ranges: list[tuple[float, float, str]], exposed: list[Interval]
) -> dict[str, float]:
    """Label every moment of the window once; the labels' lengths add up to the window's length."""
    cuts = {window[0], window[1]}
    for start, end, _ in phase_ranges:
        cuts.update(min(max(t, window[0]), window[1]) for t in (start, end))
    for start, end in exposed:
        cuts.update(min(max(t, window[0]), window[1]) for t in (start, end))
    totals = dict.fromkeys(_PARTS, 0.0)
    ordered = sorted(cuts)
    for left, right in pairwise(ordered):
        middle = (left + right) / 2
        if _covers(exposed, middle):
            label = "exposed_comm"
        else:
            covering = [(start, -end, name) for start, end, name in phase_ranges if start <= middle < end]
            # Ranges on one thread nest, so the one that started last is the innermost, the most
            # specific: a zero_grad inside a derived forward span is optimizer time.
            label = max(covering)[2] if covering else "other"
        totals[label] += right - left
    return totals


def _union(intervals: Iterable[Interval]) -> list[Interval]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def _intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The intersection of two unions (sorted, disjoint interval lists)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """a minus b, both unions (sorted, disjoint interval lists)."""
    out = []
    for start, end in a:
        for cut_start, cut_end in b:
            if cut_end <= start or cut_start >= end:
                continue
            if cut_start > start:
                out.append((start, cut_start))
            start = max(start, cut_end)
        if start < end:
            out.append((start, end))
    return out


def _covers(union: list[Interval], t: float) -> bool:
    """Whether t lies in a union (sorted, disjoint interval list)."""
    index = bisect_right(union, (t, float("inf"))) - 1
    return index >= 0 and union[index][1] > t


def _length(union: list[Interval]) -> float:
    return sum(end - start for start, end in union)
