"""Points of a training run that other parts of gradsync listen for: a step done, a checkpoint written.

The trainer and the checkpointer say when they reach them; under `gradsync run`, the worker
listens (`gradsync.run.injector` fires an injected fault at its step). Training code does not
know who listens, and with no listener a report is one check of a module global.

What a step is: gradsync's trainer claims the steps (`claim_steps()`) and reports each optimizer
step; in any other script, step n is the n-th backward pass whose gradients DDP synchronises,
which `gradsync run`'s collective recorder reports.
"""

from __future__ import annotations

from typing import Protocol


class Listener(Protocol):
    def step(self, step: int) -> None:
        """Step `step` (counted from 1) is done."""

    def checkpoint(self, step: int) -> None:
        """This rank wrote its part of step `step`'s checkpoint, which is not committed yet."""


_listener: Listener | None = None
_steps_claimed = False
_claimed_step: int | None = None  # the latest step the training code reported


def listen(listener: Listener | None) -> None:
    """Send this process's steps and checkpoints to `listener` (None: to nobody)."""
    global _listener
    _listener = listener


def claim_steps() -> None:
    """Training code that counts optimizer steps itself says so; backward passes stop counting."""
    global _steps_claimed
    _steps_claimed = True


def optimizer_step(step: int) -> None:
    global _claimed_step
    _claimed_step = step
    if _listener is not None:
        _listener.step(step)


def claimed_step() -> int | None:
    """The training code's own count of optimizer steps (a resumed trainer continues it), None
    when it claims none."""
    return _claimed_step if _steps_claimed else None


def checkpoint_written(step: int) -> None:
    if _listener is not None:
        _listener.checkpoint(step)


def backward_pass(passes: int) -> None:
    """The count of synchronised backward passes: the steps of a script that claims none."""
    if _listener is not None and not _steps_claimed:
        _listener.step(passes)
