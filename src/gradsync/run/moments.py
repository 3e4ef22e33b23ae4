"""The moments of a training run under `--doctor-steps K`, offered by one host object: the extension
point the doctor's script check (gradsync.doctor.script) plugs into. Nothing here knows a check.

The worker's patches (gradsync.run.script_facts) see the script build its wrapped models, run
training forwards, take optimizer steps and call collectives, and offer each as a moment on the
host (`Moments`); a watch listens to the moments it needs (`Moments.on`) and keeps its own facts.
The host knows its listeners only as functions: no watch holds another, and the host holds no
watch, so a watch is added or left out without touching the others.

Besides the moments, the host keeps the little state every watch reads the same way: the models
wrapped so far and their parameters, and the counts of training forwards and optimizer steps;
and it reads once per step, for every watch that asks, what goes into it (`going_in`).

What watches a run carries, and how their facts are judged, is a `ScriptProbe`: given to the
launcher by its caller (the command line gives gradsync.doctor.script), named in the run's
options for the workers, which import it by that name, and given again to whoever makes a
diagnosis from kept evidence.
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch

from gradsync.run.check_primitives import ModuleForwards, Patches, group_ranks, hyperparameters, tensors_fingerprint
from gradsync.run.harmless import Bookkeeping, BookkeepingByKind, IdentityMap

if TYPE_CHECKING:
    from gradsync.run.companions import CompanionModules, CompanionState
    from gradsync.run.tensor_writes import TensorWrites
    from gradsync.rundir.records import Finding


class Watch(Protocol):
    """What one watch records on each rank from the host's moments."""

    def install(self, patches: Patches) -> None:
        """Patch what it watches (beyond the host's moments), each replacement kept in `patches`."""

    def facts(self) -> Mapping[str, Any]:
        """Its facts, JSON-ready: written under its name in the rank's facts file, and read by its
        probe's rules in the launcher."""


class ScriptProbe(Protocol):
    """The watches a `--doctor-steps` run carries and the rules that judge what they record: a
    module (gradsync.doctor.script), so that a worker finds it again by its `__name__`."""

    __name__: str

    def check_names(self) -> list[str]:
        """The names `--doctor-checks` may select."""

    def parse_names(self, text: str, option: str = ...) -> list[str]:
        """The names an option's value selects, checked (a gradsync ConfigError for an unknown one)."""

    def watches(self, moments: Moments, bookkeeping: BookkeepingByKind, names: Collection[str] | None) -> dict[str, Watch]:
        """On a rank: the selected checks' watches, by name, listening to `moments`."""

    def findings(self, facts: Mapping[int, Mapping[str, Any]], names: Collection[str] | None = None) -> list[Finding]:
        """In the launcher: what the ranks' facts (global rank -> facts) show."""

    def explained_by(self, found: list[Finding]) -> set[str]:
        """The categories (of a check, or of `gradsync run` itself) that these findings explain."""


def probe_named(name: str) -> ScriptProbe:
    """The probe a run's options name (a module path), imported in a worker."""
    return importlib.import_module(name)  # type: ignore[return-value]


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
    "collective": "(op, args, kwargs, site): the script called torch.distributed's op (one of the collectives on "
    "tensors in gradsync.run.script_facts.COLLECTIVES_OFFERED) with these arguments, at this line",
    "collective_returned": "(op, args, kwargs, site, returned): a collective the script called itself returned "
    "(its outputs written, or its work started when async_op=True; returned: None), or one of the differentiable "
    "collectives of torch.distributed.nn did (returned: its result, the argument left as it was)",
    "pipeline_message": "(message, signature): a pipeline stage sent or received a labelled message "
    "(gradsync.run.pipeline_labels.PipelineMessage; signature: its tensor and peer, as recorded)",
    "file_written": "(file, how): the script wrote `file` with torch.save (how='torch.save'), or opened it for "
    "writing from its own files (how='open'; libraries open files of their own)",
    "bucket_reduction": "(bucket, reduction): a DDP comm hook is handed a gradient bucket (its buffer holds this rank's "
    "gradients), and again once it returned (reduction.future set): gradsync.run.collectives.BucketReduction says "
    "which hook, registered where, and whether it is gradsync's stand-in for DDP's own averaging",
    "state_written": "(write): a call outside the optimizer's step wrote to the training state: the parameters, "
    "their gradients or the buffers of a wrapped model, a parameter an optimizer steps, or the state of a module "
    "run beside them (gradsync.run.companions) (gradsync.run.tensor_writes.StateWrite, with the user's line)",
}


class Moments:
    """The host: what happened so far, and who listens to what happens next."""

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        # What the run asked of its probe beyond the checks (RunOptions.probe_config): read by the
        # watches it concerns (a window to trace line by line).
        self.config: Mapping[str, Any] = config or {}
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
        self.tensor_writes: TensorWrites | None = None  # the "state_written" moment's source (None: not installed)
        # The modules the training step runs beside the wrapped models (installed with "state_written").
        self.companions: CompanionModules | None = None
        self.loop: types.CodeType | None = None  # the function that made the first counted optimizer step
        self.created = IdentityMap()  # parameter -> the user's line that created it (nn.Parameter)

    def on(self, moment: str, listener: Callable[..., None], bookkeeping: Bookkeeping) -> None:
        """Call `listener` at each `moment`; its failure is said once by `bookkeeping`, and never
        reaches the script."""
        self._listeners[moment].append((listener, bookkeeping))

    def emit(self, moment: str, *args: Any) -> None:
        if not self._listeners[moment]:
            return
        # The watches' own tensor calls (fingerprints, samples) are gradsync's: torch's Python
        # dispatch is off for them, so the state-write mode neither reads nor slows them.
        with torch._C.DisableTorchFunction():
            for listener, bookkeeping in self._listeners[moment]:
                with bookkeeping:
                    listener(*args)

    def listened(self, moment: str) -> bool:
        """Whether any watch listens to `moment` (a patch that only feeds it can stay off)."""
        return bool(self._listeners[moment])

    def compiling(self, site: str | None) -> None:
        """The script called torch.compile: what dynamo cannot take (hooks common to all modules,
        the mode that reads state writes) stops here, and the checks that relied on it see only
        what ran before."""
        if self.compiled_at is None:
            self.compiled_at = site
        self.module_forwards.stop()
        if self.tensor_writes is not None:
            self.tensor_writes.stop()
        if self.companions is not None:
            self.companions.stop()

    def between_steps(self) -> None:
        """A counted optimizer step starts or ends: no module call is in progress."""
        if self.companions is not None:
            self.companions.between_steps()

    def companion_states(self) -> list[CompanionState]:
        """The state of each module the training step runs beside the wrapped models, now."""
        return self.companions.states() if self.companions is not None else []

    def created_at(self, parameter: Any) -> str | None:
        """The user's line that created `parameter` (None where it is not known)."""
        return self.created.get(parameter)

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
