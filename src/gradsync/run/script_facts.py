"""The worker side of `gradsync run --doctor-steps K`: what each rank saw of its own run, for K optimizer steps.

Some mistakes neither fail nor hang until much later, or never: every rank training on the same
batches, a sampler that repeats the first epoch's order, ranks with different numbers of
batches (a hang at the end of the first epoch), gradients all-reduced on every micro-step of an
accumulation, replicas that drift apart, `find_unused_parameters=True` without need. Each shows
in the first steps, but only by comparing ranks. So every rank records facts about its own run:
a cheap fingerprint of each training forward's inputs, each DataLoader's length when its
iteration starts, each pass of a DistributedSampler (epoch, shuffle), the synchronised backward
passes per optimizer step and, at the end, a hash of every parameter and buffer of its DDP
models. Under FSDP2 and tensor parallelism it also notes how `fully_shard` split each model
(how much the root unit holds) and fingerprints the inputs of each `parallelize_module`d
module, which the ranks of one tensor-parallel group must share. It writes them to a file in
the attempt directory when it stops (right after its K-th training step) or when the script
ends, and the launcher compares the ranks' files (the checks of gradsync.doctor.script). As in
the rest of `gradsync run`, nothing goes through the process group, which a broken script may be
stuck in.

The moments it sees (a model wrapped, a training forward starting and ending, a backward call, a
DataLoader pass and each index it draws, a training step starting and ending, a collective the
script calls) go to a host (gradsync.run.moments.Moments), where the checks that record facts of
their own (`Check.watch`: the random draws, the dataset's generators, the ranks' shares of the
data, the loss's scale, train/eval mode, the update, averaging, state writes, file writes, the
split) listen; their facts go under their names. A moment no selected check listens to
(`--doctor-checks`) is not patched in.

The patches (DataLoader and its iterators, DistributedSampler, Join, DDP's constructor and
forward, a global optimizer-step hook) are installed only under --doctor-steps: a plain
`gradsync run` pays nothing for them. Each keeps its recording in a `harmless.Bookkeeping`: a
watch that fails says so once, and the script's call goes on as without it.
"""

from __future__ import annotations

import functools
import math
import re
import sys
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data.distributed import DistributedSampler

from gradsync import compat
from gradsync.callsite import caller_location, entry_site, is_user_file, user_frame
from gradsync.run.activity import generator_loop, loop_around_call, loop_iterations
from gradsync.run.collectives import CollectiveRecorder, is_gradient_reduction
from gradsync.run.companions import CompanionModules
from gradsync.run.check_primitives import Patches, group_ranks, index_sampler, inputs_fingerprint, nested_tensors, tensor_hash
from gradsync.run.harmless import BookkeepingByKind
from gradsync.run.moments import Moments, ScriptProbe
from gradsync.run.tensor_writes import COMPANION, TensorWrites
from gradsync.rundir import write_json
from gradsync.rundir.records import POINT_TO_POINT

FORWARDS_FINGERPRINTED = 64  # training forwards whose inputs are compared across ranks
MAX_RECORDS = 64  # DataLoaders and sampler passes kept per rank
TP_MODULES_WATCHED = 8  # parallelize_module'd modules whose inputs are fingerprinted
_WRITE_MODES = frozenset("wax+")  # an open() mode with one of these writes
# The collectives on tensors offered as the "collective" moment (torch.distributed's names).
COLLECTIVES_OFFERED = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                       "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter")


# torch.distributed.nn's autograd Functions (private names: where one is missing, its results are not
# watched) -> the collective, for those whose result every rank uses (reduce and gather fill dst's alone).
DIFFERENTIABLE_COLLECTIVES = {"_AllReduce": "all_reduce", "_AllGather": "all_gather", "_Broadcast": "broadcast",
                              "_Scatter": "scatter", "_Reduce_Scatter": "reduce_scatter", "_AlltoAll": "all_to_all",
                              "_AlltoAllSingle": "all_to_all_single"}
_AVERAGING = frozenset({"all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single"})
_SHAPE = re.compile(r"^(?:float|bfloat|complex)\w*\[([\d, ]*)\]")


def _elements(signature: str) -> int:
    """The element count of a recorded collective's first tensor when it is a floating-point one (0 otherwise)."""
    match = _SHAPE.match(signature)
    if match is None:
        return 0
    return math.prod(int(size) for size in match[1].split(",") if size.strip())


def _length(thing: Any) -> int | None:
    try:
        return len(thing)
    except TypeError:  # an IterableDataset without __len__, a batch sampler without one
        return None


class ScriptCheck:
    """The facts one rank gathers under --doctor-steps, and its stop after the K-th optimizer step."""

    def __init__(self, recorder: CollectiveRecorder, steps: int, path: Path, on_last_step: Callable[[], None],
                 probe: ScriptProbe, checks: list[str] | None = None, config: Mapping[str, Any] | None = None):
        """`on_last_step` ends the process once the K-th step's facts are written; `probe`: whose
        watches the rank carries; `checks`: those of its checks --doctor-checks selected (None:
        all), kept in the facts for the launcher's rules; `config`: what else the run asks of the
        probe's watches (RunOptions.probe_config)."""
        self.recorder = recorder
        self.steps_to_check = steps
        self.checks = checks
        self.path = path
        self.on_last_step = on_last_step
        self.steps = 0  # training steps taken (see _is_training_step; one inside another's step is part of it)
        self._stepping: list[bool] = []  # optimizer steps in progress, nested: whether each is a counted one
        self._optimizers: list[Any] = []  # every optimizer that stepped (outermost), in the order first seen
        self._averaging_forwards = 0  # DDP forwards with gradients on and synchronisation due
        self._averaging_forwards_before = 0  # that count at the previous counted step
        self._wrapped: set[int] = set()  # ids of the parameters of DDP models, fully_shard units, parallelize_module'd modules
        self._collectives_before = 0  # the recorder's collectives at the previous counted step
        self._synced_before = 0  # the recorder's synchronised backward passes at the previous step
        self.syncs_per_step: list[int] = []
        self.forwards: list[dict[str, Any]] = []
        self.loaders: list[dict[str, Any]] = []
        self.sampler_passes: list[dict[str, Any]] = []
        self._loader_entries: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._loaders_built_at: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # DataLoader -> its line
        self._iterator_entries: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._sampler_keys: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._current_loader: dict[str, Any] | None = None  # the loader of the batch fetched last
        self._joined = 0  # Join context managers entered and not left
        # Held, not weakly referenced: a script that returns before its K-th step has dropped its
        # own references by the time its replicas are hashed.
        self.models: list[tuple[DistributedDataParallel, str | None, list[str]]] = []  # DDP, site, parameter order
        self.fsdp_units: list[tuple[torch.nn.Module, str | None]] = []  # every module fully_shard was given
        self.tp_modules: list[dict[str, Any]] = []  # per parallelize_module call: site, group, styles, inputs
        self._parallelizing = 0  # parallelize_module calls in progress (it recurses into the plan)
        self._wrapped_modules: tuple[tuple[int, int], set[int]] = ((-1, -1), set())  # (models counted, their module ids)
        self.bookkeeping = BookkeepingByKind()  # each watch's, by kind; their failures go into the facts
        self.moments = Moments(config)  # what the checks' watches listen to, and what happened so far
        self._set_epoch_calls: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # DistributedSampler -> calls
        # The checks that record facts of their own, by name (their facts go under it).
        self.watches = probe.watches(self.moments, self.bookkeeping, checks)

    # -- installing --------------------------------------------------------------------------

    def install(self) -> Callable[[], None]:
        """Patch what the checks watch, around the recorder's patches (so install it after the
        recorder); returns a function that undoes it."""
        patches = Patches()
        patches.on_undo(self.moments.module_forwards.remove)
        if self.moments.listened("state_written"):  # before the backward moment, which it listens to
            self._install_state_written_moment(patches)
        if self.moments.listened("pipeline_message"):
            self._install_pipeline_moment(patches)
        if self.moments.listened("bucket_reduction"):
            self._install_bucket_moment(patches)
        patches.on_undo(register_optimizer_step_pre_hook(self._before_step).remove)
        patches.on_undo(register_optimizer_step_post_hook(self._after_step).remove)
        check = self
        models = self.bookkeeping["the script check's DDP watch"]
        loaders = self.bookkeeping["the script check's DataLoader watch"]
        samplers = self.bookkeeping["the script check's DistributedSampler watch"]

        def make_ddp_init(original):
            def __init__(ddp, *args, **kwargs):
                original(ddp, *args, **kwargs)
                site = None
                with models:
                    site = caller_location()
                    # The order DDP pairs the parameters across ranks in (its buckets go by position).
                    check.models.append((ddp, site, [name for name, _ in ddp.module.named_parameters()]))
                    check.moments.models.append(ddp)
                    check.moments.ddp_parameters.update(id(p) for p in ddp.module.parameters())
                    check._wrapped.update(check.moments.ddp_parameters)
                check.moments.emit("wrapped", ddp, site)

            return __init__

        # Bookkeeping that dynamo must not trace (torch.compile of a DDP model): run eagerly, at a
        # graph break before and after DDP's own forward, which dynamo traces as without gradsync.
        @torch.compiler.disable
        def forward_starts(ddp, args, kwargs):
            entry = None
            with models:
                if torch.is_grad_enabled() and compat.DDP_SYNCS_GRADIENTS.get(True, ddp):
                    check._averaging_forwards += 1  # its backward averages the model's gradients
                if ddp.training and torch.is_grad_enabled():
                    entry = check._training_forward(ddp, args, kwargs)
            if entry is not None:
                check.moments.emit("forward_starts", ddp, entry)
            check.moments.forwarding += 1
            return entry

        @torch.compiler.disable
        def forward_ends(ddp, entry):
            check.moments.forwarding -= 1
            if entry is not None:
                check.moments.emit("forward_ends", ddp, entry)

        def make_ddp_forward(original):
            def forward(ddp, *args, **kwargs):
                entry = forward_starts(ddp, args, kwargs)
                try:
                    output = original(ddp, *args, **kwargs)
                except BaseException:
                    check.moments.forwarding -= 1
                    raise
                forward_ends(ddp, entry)
                return output

            return forward

        def make_loader_iter(original):
            def __iter__(loader):
                entry = None
                with loaders:
                    entry = check._loader_entry(loader)
                if entry is not None:
                    # Before the iterator exists: with workers, its constructor already draws the first batches.
                    check.moments.emit("loader_pass", loader, entry)
                iterator = original(loader)
                if entry is not None:
                    with loaders:
                        check._iterator_entries[iterator] = entry
                        check.moments.emit("iterator_made", iterator)  # an iterator the host cannot follow is not offered
                return iterator

            return __iter__

        def make_iterator_next(original):
            def __next__(iterator):
                with loaders:
                    check._current_loader = check._iterator_entries.get(iterator)
                return original(iterator)

            return __next__

        def make_sampler_iter(original):
            def __iter__(sampler):
                with samplers:
                    key = check._sampler_key(sampler)
                    if len(check.sampler_passes) < MAX_RECORDS:
                        check.sampler_passes.append({
                            "sampler": key, "epoch": sampler.epoch, "shuffle": sampler.shuffle, "site": caller_location(),
                            "set_epoch_calls": check._set_epoch_calls.get(sampler, 0),
                            "epoch_loop": loop_around_call(sys._getframe(1)),  # where set_epoch belongs
                        })
                return original(sampler)

            return __iter__

        def make_set_epoch(original):
            def set_epoch(sampler, epoch):
                with samplers:
                    check._set_epoch_calls[sampler] = check._set_epoch_calls.get(sampler, 0) + 1
                return original(sampler, epoch)

            return set_epoch

        def make_join_enter(original):
            def __enter__(join):
                check._joined += 1
                return original(join)

            return __enter__

        def make_join_exit(original):
            def __exit__(join, *exc_info):
                check._joined -= 1
                return original(join, *exc_info)

            return __exit__

        patches.wrap(DistributedDataParallel, "__init__", make_ddp_init)
        patches.wrap(DistributedDataParallel, "forward", make_ddp_forward)
        def make_loader_init(original):
            def __init__(loader, *args, **kwargs):
                original(loader, *args, **kwargs)
                with loaders:
                    # Where the script chose the loader's dataset and sampler: the line a finding about
                    # which samples each rank sees is fixed at (the caller of a subclass's __init__).
                    check._loaders_built_at.setdefault(loader, entry_site(loader))

            return __init__

        patches.wrap(DataLoader, "__init__", make_loader_init)
        patches.wrap(DataLoader, "__iter__", make_loader_iter)

        def make_next_index(original):
            def _next_index(iterator):
                try:
                    index = original(iterator)
                except StopIteration:
                    check.moments.emit("drew", iterator, None)
                    raise
                check.moments.emit("drew", iterator, index)
                return index

            return _next_index

        iterator_class = compat.DATALOADER_ITERATOR.get()
        if iterator_class is not None:  # else which loader feeds training stays unknown (said at launch)
            patches.wrap(iterator_class, "__next__", make_iterator_next)
            if hasattr(iterator_class, "_next_index") and self.moments.listened("drew"):  # which samples each rank draws
                patches.wrap(iterator_class, "_next_index", make_next_index)
        patches.wrap(DistributedSampler, "__iter__", make_sampler_iter)
        patches.wrap(DistributedSampler, "set_epoch", make_set_epoch)
        patches.wrap(Join, "__enter__", make_join_enter)
        patches.wrap(Join, "__exit__", make_join_exit)
        self._install_sharding_watches(patches)
        self._install_compile_moment(patches)
        self._note_parameter_creations(patches)
        # A moment no selected check listens to (--doctor-checks) costs no patch.
        if self.moments.listened("collective") or self.moments.listened("collective_returned"):
            self._install_collective_moment(patches)
        if self.moments.listened("backward") or self.moments.listened("backward_ends"):
            self._install_backward_moment(patches)
        if self.moments.listened("file_written"):
            self._install_file_moment(patches)
        for watch in self.watches.values():
            watch.install(patches)
        return patches.undo

    def _install_state_written_moment(self, patches: Patches) -> None:
        """Every write to the training state outside the optimizer's step, offered as the
        "state_written" moment (gradsync.run.tensor_writes); what the state is, is read again
        whenever it may have changed: a model wrapped or sharded, a backward pass (new
        gradients), an optimizer step (its parameters, their gradients)."""
        moments = self.moments
        indexing = self.bookkeeping["the script check's state index"]
        writes = TensorWrites(lambda write: moments.emit("state_written", write),
                              self.bookkeeping["the script check's state-write watch"],
                              stepping=lambda: bool(self._stepping), forwarding=lambda: moments.forwarding > 0,
                              loop=lambda: moments.loop)
        moments.tensor_writes = writes
        state: dict[str, list[tuple[str, Any]]] = {"parameters": [], "buffers": [], "companions": []}

        def models_changed(*_: Any) -> None:  # a model wrapped, a step ended: the parameters and buffers read again
            state.update(self._state_tensors())
            own = {id(t) for _, t in (*state["parameters"], *state["buffers"])}
            state["companions"] = [(f"{c.key}: {name}", t) for c in companions.states(own) for name, t in (*c.parameters, *c.buffers)]
            gradients_changed()

        def gradients_changed(*_: Any) -> None:  # after a backward pass, before a step: only the gradients are new
            writes.index.rebuild([("parameter", name, p) for name, p in state["parameters"]]
                                 + [("gradient", name, p.grad) for name, p in state["parameters"] if p.grad is not None]
                                 + [("buffer", name, b) for name, b in state["buffers"]]
                                 + [(COMPANION, name, t) for name, t in state["companions"]])

        companions = CompanionModules(training=lambda: bool(moments.models or moments.sharded),
                                      wrapped_modules=self._wrapped_module_ids, training_state=self._training_state_ids,
                                      bookkeeping=self.bookkeeping["the script check's companion watch"],
                                      discovered=lambda: self._with(indexing, models_changed))
        moments.companions = companions
        companions.install()
        patches.on_undo(companions.stop)

        moments.on("wrapped", models_changed, indexing)
        moments.on("step_ends", models_changed, indexing)
        moments.on("backward_ends", gradients_changed, indexing)
        moments.on("step_starts", lambda optimizer, step: models_changed() if step == 1 else gradients_changed(), indexing)
        writes.install(patches)

    @staticmethod
    def _with(bookkeeping: Any, call: Callable[[], None]) -> None:
        # As a moment's listeners are called (Moments.emit): the index's own tensor calls are gradsync's.
        with bookkeeping, torch._C.DisableTorchFunction():
            call()

    def _wrapped_module_ids(self) -> set[int]:
        """The ids of the DDP objects, of every module inside them and inside the sharded units (the
        models are held, so the ids stay theirs), read again when a model is added."""
        count = (len(self.moments.models), len(self.moments.sharded))
        if self._wrapped_modules[0] != count:
            roots = [*self.moments.models, *(unit for unit, _ in self.moments.sharded)]
            self._wrapped_modules = (count, {id(m) for root in roots for m in root.modules()})
        return self._wrapped_modules[1]

    def _training_state_ids(self) -> set[int]:
        state = self._state_tensors()
        return {id(t) for _, t in (*state["parameters"], *state["buffers"])}

    def _state_tensors(self) -> dict[str, list[tuple[str, Any]]]:
        """The training state's parameters and buffers, by name: those of every model wrapped in DDP
        or sharded, and the parameters of every optimizer that stepped, named by their place in it
        when no model holds them."""
        parameters: list[tuple[str, Any]] = []
        buffers: list[tuple[str, Any]] = []
        seen: set[int] = set()
        for module in [ddp.module for ddp in self.moments.models] + [unit for unit, _ in self.moments.sharded]:
            for name, p in module.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    parameters.append((name, p))
            buffers += module.named_buffers()
        for index, optimizer in enumerate(self._optimizers):
            for g, group in enumerate(optimizer.param_groups):
                for i, p in enumerate(group["params"]):
                    if id(p) not in seen:
                        seen.add(id(p))
                        parameters.append((f"optimizer {index}: param_groups[{g}]['params'][{i}]", p))
        return {"parameters": parameters, "buffers": buffers}

    def _note_parameter_creations(self, patches: Patches) -> None:
        """Where each parameter was made (`nn.Parameter`): a finding about a parameter nobody averaged
        names the line that created it outside the wrapped model."""
        created = self.moments.created
        noting = self.bookkeeping["the script check's parameter watch"]

        def make(original):
            def __new__(cls, *args, **kwargs):
                parameter = original(cls, *args, **kwargs)
                with noting:
                    created[parameter] = caller_location()
                return parameter

            return __new__

        patches.wrap(torch.nn.Parameter, "__new__", make)

    def _install_compile_moment(self, patches: Patches) -> None:
        """torch.compile called (on a model, a function, or by `Module.compile`): told to the host."""
        moments = self.moments
        compiling = self.bookkeeping["the script check's torch.compile watch"]

        def make(original):
            def compile(*args, **kwargs):
                with compiling:
                    moments.compiling(caller_location())
                return original(*args, **kwargs)

            return compile

        patches.wrap(torch, "compile", make)

    def _install_collective_moment(self, patches: Patches) -> None:
        """The collectives a script calls itself on tensors (hand-written averaging, a broadcast of
        parameters, a gather of features), offered as the "collective" moment with their arguments,
        as given, and the line."""
        import torch.distributed as dist

        moments = self.moments
        collectives = self.bookkeeping["the script check's collective moment"]

        def make(op: str):
            def wrap(original):
                def collective(*args, **kwargs):
                    # Arguments passed on as they came: a call torch refuses fails with torch's own error.
                    site = None
                    with collectives:
                        site = caller_location()
                        if moments.tensor_writes is not None:  # a tensor handed on to a collective was read
                            moments.tensor_writes.read_elsewhere(args, kwargs)
                        moments.emit("collective", op, args, kwargs, site)
                    result = original(*args, **kwargs)
                    with collectives:
                        # Called by the script itself: a library calling it (torch.distributed.nn) hands
                        # the result on as its own, through autograd, as another tensor.
                        if is_user_file(sys._getframe(1).f_code.co_filename):
                            moments.emit("collective_returned", op, args, kwargs, site, None)
                    return result

                return collective

            return wrap

        def make_differentiable(op: str):
            def wrap(original):
                def apply(*args, **kwargs):
                    result = original(*args, **kwargs)
                    with collectives:
                        # Through the public function, from the script's own line: one a backward pass
                        # applies hands its result to autograd, which reads it where no mode sees.
                        caller = sys._getframe(1).f_back
                        if caller is not None and is_user_file(caller.f_code.co_filename):
                            moments.emit("collective_returned", op, args, kwargs, caller_location(), result)
                    return result

                return apply

            return wrap

        for op in COLLECTIVES_OFFERED:
            if hasattr(dist, op):
                patches.wrap(dist, op, make(op))
        # The differentiable collectives (torch.distributed.nn) return their result and leave their
        # argument as it was. Their autograd Functions' `apply` is wrapped, not the public functions:
        # those warn of their deprecation at their caller's line, which a wrapper would become.
        from torch.distributed.nn import functional as differentiable

        for name, op in DIFFERENTIABLE_COLLECTIVES.items():
            function = getattr(differentiable, name, None)
            if isinstance(function, type) and issubclass(function, torch.autograd.Function):
                patches.wrap(function, "apply", make_differentiable(op))

    def _install_pipeline_moment(self, patches: Patches) -> None:
        """Each pipeline message the recorder labels (gradsync.run.pipeline_labels), offered as the
        "pipeline_message" moment: the recorder already knows what it carries."""
        moments, listeners = self.moments, self.recorder.pipeline_labels.listeners
        messages = self.bookkeeping["the script check's pipeline moment"]

        def heard(message: Any, signature: str) -> None:
            with messages:
                moments.emit("pipeline_message", message, signature)

        listeners.append(heard)
        patches.on_undo(lambda: listeners.remove(heard) if heard in listeners else None)

    def _install_bucket_moment(self, patches: Patches) -> None:
        """Each gradient bucket a DDP comm hook reduces, offered as the "bucket_reduction" moment
        before and after the hook: the recorder already wraps every Python hook."""
        moments, listeners = self.moments, self.recorder.bucket_listeners

        def handed(bucket: Any, reduction: Any) -> None:
            moments.emit("bucket_reduction", bucket, reduction)

        listeners.append(handed)
        patches.on_undo(lambda: listeners.remove(handed) if handed in listeners else None)

    def _install_backward_moment(self, patches: Patches) -> None:
        """Every backward call, offered as the "backward" moment with the tensors it starts from,
        and as "backward_ends" once it returned, saying whether DDP averaged gradients in it."""
        import torch.autograd

        moments, recorder = self.moments, self.recorder
        original = torch.autograd.backward

        @functools.wraps(original)
        def backward(tensors, *args, **kwargs):
            moments.emit("backward", tensors)
            synced_before = recorder.backward_passes
            result = original(tensors, *args, **kwargs)
            moments.emit("backward_ends", recorder.backward_passes > synced_before)
            return result

        patches.replace(torch.autograd, "backward", backward)  # Tensor.backward calls it through the module

    def _install_file_moment(self, patches: Patches) -> None:
        """The files the script writes, offered as the "file_written" moment: `torch.save`, and
        `open` for writing called from the script's own files (torch.save and libraries open
        files of their own)."""
        import builtins

        moments = self.moments
        files = self.bookkeeping["the script check's file moment"]

        def make_save(original):
            def save(obj, f, *args, **kwargs):
                moments.emit("file_written", f, "torch.save")
                return original(obj, f, *args, **kwargs)

            return save

        patches.wrap(torch, "save", make_save)
        original_open = builtins.open

        @functools.wraps(original_open)
        def open_(file, mode="r", *args, **kwargs):
            writes = False
            with files:
                writes = isinstance(mode, str) and bool(_WRITE_MODES & set(mode)) and is_user_file(sys._getframe(1).f_code.co_filename)
            if writes:
                moments.emit("file_written", file, "open")
            return original_open(file, mode, *args, **kwargs)

        patches.replace(builtins, "open", open_)

    def _install_sharding_watches(self, patches: Patches) -> None:
        """Wrap `fully_shard` and `parallelize_module` where scripts import them from."""
        import torch.distributed.fsdp as fsdp
        import torch.distributed.tensor.parallel as tensor_parallel
        import torch.distributed.tensor.parallel.api as tensor_parallel_api

        check = self
        sharding = self.bookkeeping["the script check's sharding watch"]
        original_shard = fsdp.fully_shard
        original_parallelize = tensor_parallel.parallelize_module

        @functools.wraps(original_shard)
        def fully_shard(module, *args, **kwargs):
            result = original_shard(module, *args, **kwargs)
            with sharding:
                site = caller_location()
                for unit in module if isinstance(module, (list, tuple)) else [module]:
                    check.fsdp_units.append((unit, site))
                    check.moments.sharded.append((unit, site))
                    check._wrapped.update(id(p) for p in unit.parameters())  # fully_shard's own, replaced ones
            return result

        @functools.wraps(original_parallelize)
        def parallelize_module(module, device_mesh=None, parallelize_plan=None, *args, **kwargs):
            # parallelize_module applies a plan by calling itself on each planned submodule: only
            # the outermost call is the user's module, whose inputs the whole group must share.
            check._parallelizing += 1
            try:
                result = original_parallelize(module, device_mesh, parallelize_plan, *args, **kwargs)
            finally:
                check._parallelizing -= 1
            if not check._parallelizing:
                with sharding:
                    check._wrapped.update(id(p) for p in result.parameters())  # a step of these is the training's
                    check._watch_tp_module(result, device_mesh, parallelize_plan)
            return result

        for owner in (fsdp, sys.modules.get("torch.distributed.fsdp._fully_shard")):
            if owner is not None and getattr(owner, "fully_shard", None) is original_shard:
                patches.replace(owner, "fully_shard", fully_shard)
        for owner in (tensor_parallel, tensor_parallel_api):
            if getattr(owner, "parallelize_module", None) is original_parallelize:
                patches.replace(owner, "parallelize_module", parallelize_module)

    def _watch_tp_module(self, module: torch.nn.Module, mesh: Any, plan: Any) -> None:
        if len(self.tp_modules) >= TP_MODULES_WATCHED or mesh is None:
            return
        import torch.distributed as dist

        try:
            ranks = dist.get_process_group_ranks(mesh.get_group()) if mesh.ndim == 1 else None
        except (RuntimeError, ValueError, AttributeError):
            ranks = None
        styles = plan.values() if isinstance(plan, Mapping) else [plan]
        entry: dict[str, Any] = {"site": caller_location(), "ranks": ranks,
                                 "styles": sorted({type(style).__name__ for style in styles}), "inputs": []}
        self.tp_modules.append(entry)

        from torch.distributed.tensor import DTensor

        sharding = self.bookkeeping["the script check's sharding watch"]

        def fingerprint_inputs(_module: Any, args: tuple) -> None:
            with sharding:
                if not (_module.training and torch.is_grad_enabled()) or len(entry["inputs"]) >= FORWARDS_FINGERPRINTED:
                    return
                # A DTensor input is distributed already (reading it whole would be a collective): not compared.
                plain = not any(isinstance(t, DTensor) for t in nested_tensors(args))
                entry["inputs"].append(inputs_fingerprint(args, {}) if plain else None)

        self.moments.module_forwards.watch(module, fingerprint_inputs)

    # -- recording ---------------------------------------------------------------------------

    def _sampler_key(self, sampler: DistributedSampler) -> int:
        key = self._sampler_keys.get(sampler)
        if key is None:
            key = self._sampler_keys[sampler] = len(self._sampler_keys)
        return key

    def _loader_entry(self, loader: DataLoader) -> dict[str, Any]:
        entry = self._loader_entries.get(loader)
        if entry is None:
            site = caller_location()
            sampler = index_sampler(loader)
            entry = {
                # Ranks run the same code, so the n-th loader iterated at a line is the same loader.
                "key": f"{site}#{sum(1 for other in self.loaders if other['site'] == site)}",
                "site": site,
                "batches": _length(loader),
                "samples": _length(sampler) if sampler is not None else None,
                "sampler": self._sampler_key(sampler) if isinstance(sampler, DistributedSampler) else None,
                "feeds_training": False,
                "under_join": self._joined > 0,
                "built_at": self._loaders_built_at.get(loader),
                # What a schedule sized from the data counts: the dataset's samples, per batch, and
                # the epochs of the loop around this first pass (None: not a `range` of plain values).
                "dataset_samples": _length(loader.dataset) if not isinstance(loader.dataset, IterableDataset) else None,
                "batch_size": loader.batch_size,
                "epochs": loop_iterations(sys._getframe(1)),
                # An IterableDataset chooses its own samples: the loop of its __iter__ that walks them.
                "dataset_loop": generator_loop(type(loader.dataset).__iter__)
                if isinstance(loader.dataset, IterableDataset) else None,
            }
            self._loader_entries[loader] = entry
            if len(self.loaders) < MAX_RECORDS:
                self.loaders.append(entry)
        return entry

    def _training_forward(self, ddp: DistributedDataParallel, args: tuple, kwargs: dict) -> dict[str, Any] | None:
        loader = self._current_loader
        if loader is not None:
            loader["feeds_training"] = True
        if len(self.forwards) >= FORWARDS_FINGERPRINTED:
            return None
        entry = {"fingerprint": inputs_fingerprint(args, kwargs), "site": caller_location(),
                 "loader": loader["site"] if loader else None}
        self.forwards.append(entry)
        self.moments.forwards = len(self.forwards)
        return entry

    def _is_training_step(self, optimizer: Any) -> bool:
        """Whether an optimizer step is one of the distributed training's, the steps --doctor-steps
        counts: it steps a parameter of a DDP model, a fully_shard unit or a parallelize_module'd
        module, or, since the previous one, the rank reduced a floating-point tensor the size of
        one of its parameters or more, up to all of them together (hand-written averaging of
        gradients or parameters, by tensor or flattened in buckets), or ran a DDP model's forward
        whose backward averages its gradients (another model trained beside it: a GAN's
        discriminator left unwrapped), or sent or received tensors point to point (a pipeline
        stage's activations and gradients). A rank-local optimization
        (rank 0 fitting a model of its own before training, a probe) is not, even after a barrier
        or an object broadcast: counted, it would make that rank stop early, inside a collective
        its peers are still in."""
        with self.bookkeeping["the script check's step counter"]:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            if any(id(p) in self._wrapped for p in params):
                return True
            sizes = [p.numel() for p in params]
            if not sizes:
                return False
            low, high = min(sizes), sum(sizes)
            if self._averaging_forwards > self._averaging_forwards_before:
                return True
            return any(record.index >= self._collectives_before and (
                record.op in POINT_TO_POINT or (record.op in _AVERAGING and low <= _elements(record.signature) <= high))
                for record in self.recorder.ring)
        return True  # the count's failure: as before it existed, every step counts

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._stepping and all(seen is not optimizer for seen in self._optimizers):
            self._optimizers.append(optimizer)
        counted = not self._stepping and self._is_training_step(optimizer)
        self._stepping.append(counted)
        if counted:
            if self.moments.loop is None:  # the training loop: the function that steps the optimizer
                frame = user_frame(sys._getframe(1))
                self.moments.loop = frame.f_code if frame is not None else None
            self.moments.between_steps()
            self.moments.reductions = self.recorder.backward_passes
            self.moments.emit("step_starts", optimizer, self.steps + 1)

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        counted = self._stepping.pop() if self._stepping else False  # a hook installed mid-step sees only its end
        if not counted:  # a local optimization, or one inside another's step (ZeroRedundancyOptimizer's local one)
            return
        self.steps += 1
        self.moments.steps = self.steps
        self._collectives_before = self.recorder.count
        self._averaging_forwards_before = self._averaging_forwards
        self.moments.between_steps()
        self.moments.emit("step_ends", optimizer, self.steps)
        synced = self.recorder.backward_passes
        self.syncs_per_step.append(synced - self._synced_before)
        self._synced_before = synced
        if self.steps == self.steps_to_check:
            self.write()
            self.on_last_step()

    # -- the facts ---------------------------------------------------------------------------

    def _last_backward_site(self) -> str | None:
        for record in reversed(self.recorder.ring):
            if is_gradient_reduction(record.kind):
                return record.site
        return None

    def _model_facts(self, ddp: DistributedDataParallel, site: str | None, order: list[str]) -> dict[str, Any]:
        watch = self.recorder.watch_of(ddp)
        return {
            "site": site,
            # The ranks DDP averages over: its replicas. Under pipeline (or any hybrid) parallelism each
            # stage's DDP spans only the ranks holding that stage, and only they must agree.
            "group": group_ranks(ddp.process_group),
            "parameter_order": order,
            "find_unused_parameters": bool(ddp.find_unused_parameters),
            "usage_checked_passes": watch.checked_passes,
            "incomplete_passes": watch.incomplete_passes,
            # `broadcast_buffers` (a property over `forward_sync_buffers` since torch 2.13): when
            # on, every forward starts from rank 0's buffers, so ranks differing after one is normal.
            "buffers_synced": bool(getattr(ddp, "broadcast_buffers", True)),
            "parameters": {name: tensor_hash(p) for name, p in ddp.module.named_parameters()},
            "buffers": {name: tensor_hash(b) for name, b in ddp.module.named_buffers()},
        }

    def facts(self) -> dict[str, Any]:
        return {
            "doctor_steps": self.steps_to_check,
            "checks": self.checks,
            "steps": self.steps,
            "syncs_per_step": self.syncs_per_step,
            "backward_site": self._last_backward_site(),
            "forwards": self.forwards,
            "loaders": self.loaders,
            "sampler_passes": self.sampler_passes,
            "models": [self._model_facts(*model) for model in self.models],
            "fsdp_roots": self._fsdp_roots(),
            "tp_modules": self.tp_modules,
            "compiled_at": self.moments.compiled_at,
            **self._watches_facts(),
            "watch_failures": self.bookkeeping.failures(),
        }

    def _watches_facts(self) -> dict[str, Any]:
        """Each check's own facts; one that fails leaves its check without facts (its rule says nothing)."""
        facts = {}
        for name, watch in self.watches.items():
            with self.bookkeeping[f"the {name} check's facts"]:
                facts[name] = watch.facts()
        return facts

    def _fsdp_roots(self) -> list[dict[str, Any]]:
        """For each outermost module given to fully_shard: how many parameters it holds, and how
        many stay in its own unit (outside every unit inside it), gathered whole for the whole
        forward and backward."""
        roots = []
        units = [unit for unit, _ in self.fsdp_units]
        inside_of = {id(unit): {id(m) for m in unit.modules()} for unit in units}
        for root, site in self.fsdp_units:
            if any(other is not root and id(root) in inside_of[id(other)] for other in units):
                continue  # inside another unit
            inner = {id(p) for unit in units if unit is not root and id(unit) in inside_of[id(root)]
                     for p in unit.parameters()}
            own = [(name, p) for name, p in root.named_parameters() if id(p) not in inner]
            by_child: dict[str, int] = {}
            for name, p in own:
                child = name.split(".")[0] if "." in name else "(its own)"
                by_child[child] = by_child.get(child, 0) + p.numel()
            largest = max(by_child.items(), key=lambda item: item[1]) if by_child else None
            roots.append({
                "site": site,
                "class": _user_class_name(root),
                "parameters": sum(p.numel() for p in root.parameters()),
                "in_root_unit": sum(p.numel() for _, p in own),
                "largest_in_root": list(largest) if largest else None,
            })
        return roots

    def write(self) -> None:
        """Leave the facts for the launcher; a failure here must not change how the script ends."""
        with self.bookkeeping[f"the script check's facts file ({self.path})"]:
            write_json(self.path, self.facts())


def _user_class_name(module: torch.nn.Module) -> str:
    """The class the user wrote: fully_shard swaps a module's class for a subclass named FSDP<name>."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(module)
    if isinstance(module, FSDPModule):
        cls = next((base for base in cls.__mro__[1:] if base is not FSDPModule and not issubclass(base, FSDPModule)), cls)
    return cls.__name__
