"""The moments of a training run that the checks watch, offered by one host object.

The script check's patches (gradsync.run.script_facts) see the script build its wrapped models,
run training forwards, take optimizer steps and call collectives; each check's watch listens to
the moments it needs (`Moments.on`) and keeps its own facts. The host knows its listeners only
as functions: no watch holds another, and the host holds no watch, so a check is added or left
out (`--checks`) without touching the others.

Besides the moments, the host keeps the little state every watch reads the same way: the models
wrapped so far and their parameters, and the counts of training forwards and optimizer steps;
and it reads once per step, for every watch that asks, what goes into it (`going_in`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gradsync.run.check_primitives import ModuleForwards, group_ranks, hyperparameters, tensors_fingerprint
from gradsync.run.harmless import Bookkeeping

# moment -> what its listeners are called with
MOMENTS = {
    "wrapped": "(ddp, site): a DistributedDataParallel was built",
    "forward_starts": "(ddp, forward): a recorded training forward through it starts (`forward`: its common "
    "record, with its site; the first 64 are recorded)",
    "forward_ends": "(ddp, forward): that forward returned",
    "backward": "(tensors): torch.autograd.backward (and so Tensor.backward) was called on these",
    "backward_ends": "(synchronised): that backward returned; synchronised: DDP averaged gradients during it",
    "loader_pass": "(loader, entry): a pass over a DataLoader starts, before its iterator exists (`entry`: "
    "the loader's common record, with its key and site)",
    "iterator_made": "(iterator): that pass's iterator exists",
    "drew": "(iterator, index): the iterator took its next sample index (or batch of them); None: the pass ended",
    "step_starts": "(optimizer, step): a counted optimizer step starts (step = its number, from 1)",
    "step_ends": "(optimizer, step): that step returned",
    "collective": "(op, tensors, site): the script called torch.distributed's op on these tensors",
    "pipeline_message": "(message, signature): a pipeline stage sent or received a labelled message "
    "(gradsync.run.pipeline_labels.PipelineMessage; signature: its tensor and peer, as recorded)",
    "file_written": "(file, how): the script wrote `file` with torch.save (how='torch.save'), or opened it for "
    "writing from its own files (how='open'; libraries open files of their own)",
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
        self._going_in: tuple[tuple[int, int], dict[str, Any]] | None = None  # ((optimizer id, step), its reading)
        # Forward pre-hooks on the script's modules, kept beside them (none in the module itself).
        self.module_forwards = ModuleForwards()
        self.compiled_at: str | None = None  # the first torch.compile call's line: the hooks stop there

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

    def compiling(self, site: str | None) -> None:
        """The script called torch.compile: what dynamo cannot take (hooks common to all modules)
        stops here, and the checks that relied on it see only what ran before."""
        if self.compiled_at is None:
            self.compiled_at = site
        self.module_forwards.stop()

    def stepped_parameters(self, optimizer: Any) -> list[Any]:
        """The parameters of DDP models that `optimizer` steps: the ones averaged alike on every rank."""
        return [p for group in optimizer.param_groups for p in group["params"] if id(p) in self.ddp_parameters]

    def replicas(self, optimizer: Any) -> list[int] | None:
        """The ranks that hold the same DDP model as the one `optimizer` steps (its DDP's process
        group): the ranks whose updates must agree. None: no DDP model, or a group torch cannot name."""
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for ddp in self.models:
            if any(id(p) in stepped for p in ddp.module.parameters()):
                return group_ranks(ddp.process_group)
        return None

    def going_in(self, optimizer: Any) -> dict[str, Any]:
        """Going into the step of `optimizer` starting now: a fingerprint of the DDP parameters it
        steps ("parameters") and its settings ("hyperparameters"). Read once per step, however
        many watches compare them (each fingerprint reads 256 values of every parameter)."""
        key = (id(optimizer), self.steps)
        if self._going_in is None or self._going_in[0] != key:
            self._going_in = (key, {"parameters": tensors_fingerprint(self.stepped_parameters(optimizer)),
                                    "hyperparameters": hyperparameters(optimizer)})
        return self._going_in[1]
