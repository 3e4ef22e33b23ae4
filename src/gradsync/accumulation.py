"""Gradient accumulation windows: which micro-batches form one optimizer step, and their weights.

An epoch of B batches is cut into windows of `accumulation_steps` consecutive batches; the last
window is shorter when B does not divide. Each micro-batch's loss (a mean over its samples) is
weighted by its share of the window's samples, so the accumulated gradient is the gradient of
the mean loss over every sample of the window, as if it had been one big batch, including the
short last window and a partial last batch.

If ranks agree to skip micro-batches (see `agreement`), the samples that did reach backward
are fewer than planned; the gradient is then rescaled at the optimizer step so the weights
still sum to one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


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
