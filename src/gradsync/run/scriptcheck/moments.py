"""The moments of a training run that the checks watch, offered by one host object.

The script check's patches (gradsync.run.script_facts) see the script build its wrapped models,
run training forwards, take optimizer steps and call collectives; each check's watch listens to
the moments it needs (`Moments.on`) and keeps its own facts. The host knows its listeners only
as functions: no watch holds another, and the host holds no watch, so a check is added or left
out (`--checks`) without touching the others.

Besides the moments, the host keeps the little state every watch reads the same way: the models
wrapped so far and their parameters, and the counts of training forwards and optimizer steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gradsync.run.harmless import Bookkeeping

# moment -> what its listeners are called with
MOMENTS = {
    "wrapped": "(ddp, site): a DistributedDataParallel was built",
    "step_starts": "(optimizer, step): a counted optimizer step starts (step = its number, from 1)",
    "step_ends": "(optimizer, step): that step returned",
    "collective": "(op, tensors, site): the script called torch.distributed's op on these tensors",
}


class Moments:
    """The host: what happened so far, and who listens to what happens next."""

    def __init__(self) -> None:
        self.models: list[Any] = []  # the DistributedDataParallel models built, in order
        self.ddp_parameters: set[int] = set()  # ids of their parameters (the models are held, so the ids stay theirs)
        self.sharded: list[tuple[Any, str | None]] = []  # every module fully_shard was given, and the line
        self.forwards = 0  # training forwards through a wrapped model (the first 64 are recorded)
        self.forwarding = 0  # DDP forwards in progress (a forward of the inner module outside them bypasses DDP)
        self.steps = 0  # counted optimizer steps returned
        self.reductions = 0  # DDP's synchronised backward passes so far, as of the step starting now
        self._listeners: dict[str, list[tuple[Callable[..., None], Bookkeeping]]] = {moment: [] for moment in MOMENTS}

    def on(self, moment: str, listener: Callable[..., None], bookkeeping: Bookkeeping) -> None:
        """Call `listener` at each `moment`; its failure is said once by `bookkeeping`, and never
        reaches the script."""
        self._listeners[moment].append((listener, bookkeeping))

    def emit(self, moment: str, *args: Any) -> None:
        for listener, bookkeeping in self._listeners[moment]:
            with bookkeeping:
                listener(*args)

    def listened(self, moment: str) -> bool:
        """Whether any watch listens to `moment` (a patch that only feeds it can stay off)."""
        return bool(self._listeners[moment])
