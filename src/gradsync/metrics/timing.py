"""Timing of steps and of the gradient communication that was not hidden behind backward.

DDP launches each bucket's all-reduce as soon as the bucket's gradients are ready, while
backward keeps computing the rest; `loss.backward()` returns only when every reduction has
finished. So the communication left exposed is the time from the moment the last bucket
became ready (compute is done) to the moment backward returned. `CommTimer` wraps the DDP
communication hook to stamp those moments; it adds no synchronisation of its own.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator, Union

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

Mark = Union[float, "torch.cuda.Event"]


class Clock:
    """Timestamps on the timeline where the work runs.

    On the CPU that is wall time. On CUDA, kernels run asynchronously, so a wall-clock stamp
    would say when work was queued, not when it ran: marks are CUDA events on the current
    stream, read (with a wait) only when a step's metrics are resolved.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Mark:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start: Mark, end: Mark) -> float:
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end) / 1000.0
        return end - start


def bus_factor(world_size: int) -> float:
    """nccl-tests' all-reduce correction: each byte crosses 2(n-1)/n links' worth of bandwidth."""
    return 2 * (world_size - 1) / world_size if world_size > 1 else 1.0


def synchronized_time(device: torch.device) -> float:
    """Wall time once the device's queued work is done: for timing blocks of steps, not each step."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


Hook = Callable[[Any, dist.GradBucket], torch.futures.Future]


class CommTimer:
    """A DDP communication hook that stamps when buckets become ready, around an inner hook.

    The inner hook (DDP's own all-reduce by default, or a user/compression hook) does the
    communication; this wrapper only records timestamps and counts reduction passes, so any
    hook gets its exposed communication measured the same way.
    """

    def __init__(self, clock: Clock, inner: Hook | None = None, inner_state: Any = None) -> None:
        self.clock = clock
        self.inner = inner or default_hooks.allreduce_hook
        self.inner_state = inner_state
        self.reductions = 0  # complete gradient reduction passes (one per synced backward)
        self.buckets = 0
        self.bucket_bytes = 0  # gradient bytes handed to the reduction, before any compression
        self._first_ready: Mark | None = None
        self._last_ready: Mark | None = None
        self._silent = False

    # Left unannotated on purpose: DDP validates a hook's annotations by identity, and this
    # module's postponed (string) annotations would fail that check.
    def hook(self, state, bucket):  # type: ignore[no-untyped-def]
        if self._silent:
            buffer = bucket.buffer()
            unreduced = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)
            unreduced.set_result(buffer)
            return unreduced
        self._last_ready = self.clock.mark()
        if self._first_ready is None:
            self._first_ready = self._last_ready
        self.buckets += 1
        buffer = bucket.buffer()
        self.bucket_bytes += buffer.numel() * buffer.element_size()
        if bucket.is_last():
            self.reductions += 1
        return self.inner(state if self.inner_state is None else self.inner_state, bucket)

    @contextlib.contextmanager
    def silent(self) -> Iterator[None]:
        """Inside, buckets come back unreduced, uncounted and unseen by the inner hook: for a
        backward that only moves DDP's bookkeeping (gradsync.bucket_layout's replay)."""
        self._silent = True
        try:
            yield
        finally:
            self._silent = False

    def register(self, ddp_model: torch.nn.parallel.DistributedDataParallel, process_group: Any) -> None:
        ddp_model.register_comm_hook(process_group, self.hook)

    def start_backward(self) -> None:
        self._first_ready = self._last_ready = None

    def first_ready(self) -> Mark | None:
        """When the first bucket of the current backward became ready: communication starts there.

        From it to the end of backward is an upper bound on the time the reduction took (it may
        overlap compute), so bytes over that window give a lower bound on the bandwidth achieved.
        """
        return self._first_ready

    def last_ready(self) -> Mark | None:
        """When the last bucket of the current backward became ready; None if none was reduced.

        The exposed communication of that backward is the interval from this mark to the end of
        backward; it is resolved later, with the rest of the step, to avoid a sync per backward.
        """
        return self._last_ready
