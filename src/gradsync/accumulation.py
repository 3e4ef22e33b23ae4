"""Gradient accumulation windows: which micro-batches form one optimizer step, and their weights.

An epoch of B batches is cut into windows of `accumulation_steps` consecutive batches; the last
window is shorter when B does not divide. Each micro-batch's loss (a mean over its samples) is
weighted by its share of the window's samples, so the accumulated gradient is the gradient of
the mean loss over every sample of the window, as if it had been one big batch, including the
short last window and a partial last batch.

If ranks agree to skip micro-batches (see `agreement`), the samples that did reach backward
are fewer than planned; the gradient is then rescaled at the optimizer step so the weights
still sum to one.

The number of micro-batches per window is the user's `accumulation_steps` unless auto (allowed
by `max_accumulation_steps`) raised it: an `AccumulationPlan` says which count holds where.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class Window:
    """One optimizer step's worth of micro-batches within an epoch."""

    pass_id: int  # which pass over the loader (an epoch, or a repeated pass over one)
    first_batch: int
    last_batch: int  # inclusive: the boundary micro-batch, where gradients are reduced
    planned_samples: int  # per rank
    applied_samples: int = 0  # samples whose loss went through backward

    def contains(self, pass_id: int, batch_index: int) -> bool:
        return pass_id == self.pass_id and self.first_batch <= batch_index <= self.last_batch

    def weight(self, batch_samples: int) -> float:
        """Factor for a micro-batch's mean loss: its share of the window's samples."""
        return batch_samples / self.planned_samples

    def correction(self) -> float:
        """Factor that makes the weights of the micro-batches actually applied sum to one."""
        return self.planned_samples / self.applied_samples


def plan_window(
    pass_id: int,
    batch_index: int,
    batches_in_epoch: int,
    accumulation_steps: int,
    batch_size_at: Callable[[int], int],
) -> Window:
    """The window containing batch `batch_index`; windows start at multiples of accumulation_steps.

    Anchoring windows to batch positions (not to a running counter) keeps them identical on
    every rank and after a resume mid-epoch.
    """
    first = batch_index - batch_index % accumulation_steps
    last = min(first + accumulation_steps, batches_in_epoch) - 1
    planned = sum(batch_size_at(i) for i in range(first, last + 1))
    return Window(pass_id=pass_id, first_batch=first, last_batch=last, planned_samples=planned)


@dataclass
class AccumulationPlan:
    """Micro-batches per optimizer step at each batch of each epoch: `steps`, and `raised_to`
    from batch `from_batch` of epoch `from_epoch` on.

    The change starts at a batch index that is a multiple of both counts, so the windows before
    it end exactly there and every window after it starts at a multiple of the new count: windows
    stay anchored to batch positions (`plan_window`), identical on every rank and after a resume.
    """

    steps: int
    raised_to: int | None = None
    from_epoch: int = 0
    from_batch: int = 0

    def steps_at(self, epoch: int, batch_index: int) -> int:
        if self.raised_to is not None and (epoch, batch_index) >= (self.from_epoch, self.from_batch):
            return self.raised_to
        return self.steps

    def windows(self, epoch: int, batches: int) -> int:
        """Optimizer steps in `epoch`, of `batches` batches."""
        if self.raised_to is None or epoch < self.from_epoch:
            return math.ceil(batches / self.steps)
        if epoch > self.from_epoch:
            return math.ceil(batches / self.raised_to)
        # raise_to() starts the new count before the epoch's end
        return math.ceil(self.from_batch / self.steps) + math.ceil((batches - self.from_batch) / self.raised_to)

    def raise_to(self, steps: int, epoch: int, next_batch: int, batches: int) -> None:
        """Use `steps` (a multiple of the current count) from the first batch at or after
        `next_batch` where a window of `steps` would start, or from the next epoch."""
        if steps % self.steps or steps <= self.steps:
            raise ValueError(f"accumulation can only be raised to a multiple of {self.steps}, not {steps}")
        first = -(-next_batch // steps) * steps
        self.raised_to = steps
        self.from_epoch, self.from_batch = (epoch, first) if first < batches else (epoch + 1, 0)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "raised_to": self.raised_to, "from_epoch": self.from_epoch, "from_batch": self.from_batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps, self.raised_to = int(state["steps"]), state["raised_to"]
        self.from_epoch, self.from_batch = int(state["from_epoch"]), int(state["from_batch"])
