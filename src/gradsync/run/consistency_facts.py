"""The worker side of the doctor's consistency checks: what must agree across ranks, recorded per rank.

DDP keeps the replicas identical, so the mistakes that matter most leave no trace in the model:
every rank drawing the same dropout masks, samplers that hand two ranks the same samples, a
loss that DDP's average divides once more, rank 0 training in eval mode, parameters paired by
position in a different order, an update (clipping, a learning rate) changed on one rank only.
Each one shows only by comparing what the ranks did, so each rank records, under --doctor-steps
only (the checks that keep their own watch, in their own module of gradsync.run.scriptcheck,
are not here: same_file, data_split, averaging, state_writes):

- the state of every random generator around each training forward (torch, CUDA, `random`,
  NumPy), the seeding calls with their lines, and the generators a DataLoader's dataset holds
  when workers copy it;
- the indices each DataLoader pass draws, mapped through `Subset` to the dataset (with its
  DistributedSampler's seed and rank);
- which submodules are in eval mode at each training forward and each optimizer step, and the
  line that set them so;
- the parameter names in order when DDP is built;
- before each optimizer step, a fingerprint of the DDP parameters' gradients and parameters
  and the optimizer's hyperparameters, with the calls made since the previous step that change
  them (clipping, schedulers) and their lines;
- how the loss passed to backward is normalised (read from the autograd graph: a mean, a sum,
  constant factors), and backward calls per optimizer step;

`ScriptCheck` owns one `ConsistencyWatch`, feeds it the moments it already sees (DDP built, a
training forward, an optimizer step) and writes its facts beside its own; the launcher compares
them (the checks of gradsync.run.scriptcheck). The watch reads what happened so far (models
wrapped, forwards, steps) from the host they share (`scriptcheck.moments.Moments`).
"""

from __future__ import annotations

import functools
import random
import re
import sys
import warnings
import weakref
import zlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import Subset
from torch.utils.data.distributed import DistributedSampler

from gradsync.run.callsite import OWN, caller_location, file_kind, short_path
from gradsync.run.check_primitives import Patches, index_sampler, tensor_hash, tensors_fingerprint
from gradsync.run.harmless import BookkeepingByKind
from gradsync.run.scriptcheck.moments import Moments

MAX_INDICES = 200_000  # a sampler pass longer than this keeps no indices (too large to compare)
INDEXED_PASSES = 4  # passes per DataLoader whose indices are kept
MAX_RECORDS = 64  # seeds, steps, loss walks kept per rank
CALLS_PER_STEP = 16  # update-changing calls kept between two optimizer steps
EVAL_NAMES = 8  # eval-mode submodule names kept per forward
LOSS_WALKS = 8  # backward calls whose loss normalisation is read
_GRAPH_NODES = 16  # autograd nodes walked down from a loss to its reduction


def _crc(data: bytes | memoryview, start: int = 0) -> int:
    return zlib.crc32(data, start)


# -- random generators --------------------------------------------------------------------------


def generator_states() -> dict[str, int]:
    """A CRC of each process-wide random generator's state: what dropout and augmentation draw from."""
    states = {"torch": tensor_hash(torch.get_rng_state()), "random": _crc(repr(random.getstate()).encode())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = tensor_hash(torch.cuda.get_rng_state())
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        states["numpy"] = _crc(memoryview(numpy.random.get_state()[1]))
    return states


def generator_state(value: Any) -> int | None:
    """The state CRC of a generator object a dataset may hold (None when it is not one)."""
    numpy = sys.modules.get("numpy")
    if isinstance(value, torch.Generator):
        return tensor_hash(value.get_state())
    if isinstance(value, random.Random):
        return _crc(repr(value.getstate()).encode())
    if numpy is not None and isinstance(value, numpy.random.Generator):
        return _crc(repr(value.bit_generator.state).encode())
    if numpy is not None and isinstance(value, numpy.random.RandomState):
        return _crc(memoryview(value.get_state()[1]))
    return None


def dataset_generators(dataset: Any, depth: int = 2) -> dict[str, Any]:
    """attribute path -> the generators stored on a dataset (and on its attributes: a transform, a
    wrapped dataset), which DataLoader workers receive as copies."""
    found: dict[str, Any] = {}
    seen: set[int] = set()

    def visit(obj: Any, path: str, level: int) -> None:
        if id(obj) in seen or level > depth:
            return
        seen.add(id(obj))
        attributes = getattr(obj, "__dict__", None)
        if not isinstance(attributes, dict):
            return
        for name, value in attributes.items():
            if generator_state(value) is not None:
                found[f"{path}.{name}" if path else name] = value
            elif not isinstance(value, (torch.Tensor, nn.Module, str, bytes, int, float, list, tuple, dict)):
                visit(value, f"{path}.{name}" if path else name, level + 1)

    visit(dataset, "", 0)
    return found


# -- the loss, read from the autograd graph ------------------------------------------------------


def _constant(value: Any) -> float | None:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.requires_grad:
        return float(value.detach().reshape(()).cpu())
    return float(value) if isinstance(value, (int, float)) else None


def _inputs(node: Any) -> list[Any]:
    return [child for child, _ in node.next_functions if child is not None]


def loss_normalisation(loss: torch.Tensor) -> dict[str, Any] | None:
    """How a scalar loss weighs each reduced element: {"scale", "reduction", "elements", "factor",
    "factor_site"}, the last the line that applied the first constant factor (when anomaly mode kept it).

    Walking down from the loss through constant factors (x / c, x * c) to the reduction (a mean,
    a sum, a loss function's own reduction): `scale` is the loss divided by the mean of the
    reduced elements, 1 for a plain mean, 1/accumulation for an accumulated one, 1/world size
    for a mean divided by the world size. None when the graph says nothing certain: a loss
    that adds terms (their weights are the script's choice), a partial reduction, another op.
    """
    node, factor, factor_site = loss.grad_fn, 1.0, None
    for _ in range(_GRAPH_NODES):
        if node is None:
            return None
        name = type(node).__name__
        inputs = _inputs(node)
        if name in ("DivBackward0", "MulBackward0") and len(inputs) == 1:
            constant = _constant(getattr(node, "_saved_other", None))
            if constant is None or constant == 0:
                return None
            factor = factor / constant if name == "DivBackward0" else factor * constant
            factor_site = factor_site or _created_at(node)
            node = inputs[0]
            continue
        if name in _SCALE_KEEPING and len(inputs) == 1:
            node = inputs[0]
            continue
        reduction, elements = _reduction(node, name)
        if reduction is None or not elements:
            return None
        scale = factor if reduction == "mean" else factor * elements
        return {"scale": scale, "reduction": reduction, "elements": elements, "factor": factor, "factor_site": factor_site}
    return None


def _created_at(node: Any) -> str | None:
    """The user's line that created an autograd node, from the forward traceback anomaly mode keeps."""
    frames = getattr(node, "metadata", {}).get("traceback_") or []
    for frame in reversed(frames):
        match = _FRAME.match(frame)
        if match and file_kind(match["file"]) == OWN:
            return f"{short_path(match['file'])}:{match['line']}"
    return None


_FRAME = re.compile(r'\s*File "(?P<file>[^"]+)", line (?P<line>\d+)')


# Ops between a loss and its reduction that keep the scale: copies, views, dtype casts (autocast).
_SCALE_KEEPING = frozenset({"CloneBackward0", "ViewBackward0", "ReshapeAliasBackward0", "SqueezeBackward0",
                            "UnsqueezeBackward0", "ToCopyBackward0"})


def _reduction(node: Any, name: str) -> tuple[str | None, int]:
    """("mean" | "sum", elements reduced) of a full reduction node, else (None, 0)."""
    if name == "MeanBackward0":
        return "mean", int(getattr(node, "_saved_self_sym_numel", 0))
    if name == "SumBackward0":
        sizes = getattr(node, "_saved_self_sym_sizes", ())
        return "sum", int(torch.Size(sizes).numel())
    code = getattr(node, "_saved_reduction", None)
    if code not in (1, 2) or not name.endswith("LossBackward0"):
        return None, 0
    # A loss function's own reduction: NLL (cross entropy) counts its non-ignored targets.
    weight = getattr(node, "_saved_total_weight", None)
    target = getattr(node, "_saved_target", None)
    reduced = getattr(node, "_saved_self", None)
    if isinstance(weight, torch.Tensor) and weight.numel() == 1 and getattr(node, "_saved_weight", None) is None:
        elements = int(weight.item())
    elif isinstance(target, torch.Tensor):
        elements = target.numel()
    else:
        elements = reduced.numel() if isinstance(reduced, torch.Tensor) else 0
    return ("mean" if code == 1 else "sum"), elements


# -- hyperparameters ---------------------------------------------------------------------------


def hyperparameters(optimizer: Any) -> str:
    """The optimizer's per-group settings (learning rate, momentum, ...) as one comparable text."""
    groups = []
    for group in optimizer.param_groups[:8]:
        items = []
        for key, value in sorted(group.items()):
            if key == "params":
                continue
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = float(value.detach().cpu())
            if isinstance(value, (bool, int, float, str, type(None))) or (
                isinstance(value, tuple) and all(isinstance(v, (int, float)) for v in value)
            ):
                items.append(f"{key}={value!r}")
        groups.append("; ".join(items))
    return " | ".join(groups)


def _never_raises(default: Any = None) -> Callable[[Callable], Callable]:
    """A watch's failure must not change how the user's script runs: it is said once per method
    (gradsync.run.harmless), and the check goes on without that record (its finding may then be
    missing, never wrong); the method returns `default` (called, when callable) instead."""

    def wrap(method: Callable) -> Callable:
        hook = f"the script check's {method.__name__}"

        @functools.wraps(method)
        def guarded(self: ConsistencyWatch, *args: Any, **kwargs: Any) -> Any:
            with self.bookkeeping[hook]:
                return method(self, *args, **kwargs)
            return default() if callable(default) else default

        return guarded

    return wrap


class ConsistencyWatch:
    """The facts of the consistency checks for one rank (see the module's docstring)."""

    def __init__(self, moments: Moments, bookkeeping: BookkeepingByKind):
        """`moments`: what the script check saw so far; `bookkeeping`: the script check's, which
        its facts report (watch_failures)."""
        self.moments = moments
        self.bookkeeping = bookkeeping
        self.seeds: list[dict[str, Any]] = []
        self.loader_draws: list[dict[str, Any]] = []
        self.worker_copies: list[dict[str, Any]] = []
        self.steps: list[dict[str, Any]] = []
        self.loss_walks: list[dict[str, Any]] = []
        self.backwards_per_step: list[int] = []
        self._backwards = 0
        self._calls: list[dict[str, Any]] = []  # update-changing calls since the last step
        self._optimizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # -> index
        self._open_step: dict[Any, dict[str, Any]] = {}  # optimizer -> its step's record, until it returns
        self._eval_sites: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> line that set eval
        self._sampler_sites: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._set_epoch_calls: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._passes: dict[str, int] = {}  # DataLoader key -> passes seen
        self._starting: tuple[dict[str, Any], list[Any]] | None = None  # a pass whose iterator is being built
        self._draws: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # iterator -> (its pass's record, Subset chain)
        self._switching_mode = 0  # nn.Module.train calls in progress (it recurses into children)
        self._tracing_graph = False  # anomaly mode switched on by this watch, until the first backward
        self._generator_sites: dict[int, str | None] = {}  # id of a NumPy Generator -> the line that made it

    # -- installing --------------------------------------------------------------------------

    def install(self, patches: Patches) -> None:
        """Patch what the watch sees, each replacement kept in `patches` (the script check's)."""
        self._install_seeding(patches)
        self._install_data(patches)
        self._install_mode(patches)
        self._install_update_calls(patches)
        self._install_backward(patches)

    def _install_seeding(self, patches: Patches) -> None:
        watch = self
        generators = self.bookkeeping["the script check's generator watch"]

        def seeding(generator: str):
            def make(original):
                def seed(*args, **kwargs):
                    watch._seeded(generator, args[0] if args else kwargs.get("seed", kwargs.get("a")))
                    return original(*args, **kwargs)

                return seed

            return make

        torch_seed = seeding("torch")(torch.manual_seed)
        torch_seed = functools.wraps(torch.manual_seed)(torch_seed)
        patches.replace(torch, "manual_seed", torch_seed)
        patches.replace(torch.random, "manual_seed", torch_seed)
        for name in ("manual_seed", "manual_seed_all"):  # the CUDA generators alone
            patches.wrap(torch.cuda, name, seeding("cuda"))
        patches.wrap(random, "seed", seeding("random"))
        try:
            import numpy
        except ImportError:  # no NumPy: no NumPy generator to watch
            return
        patches.wrap(numpy.random, "seed", seeding("numpy"))

        def make_default_rng(original):
            def default_rng(*args, **kwargs):
                generator = original(*args, **kwargs)
                with generators:
                    if len(watch._generator_sites) < MAX_RECORDS:  # where a dataset's generator came from
                        watch._generator_sites[id(generator)] = caller_location()
                return generator

            return default_rng

        patches.wrap(numpy.random, "default_rng", make_default_rng)

    def _install_data(self, patches: Patches) -> None:

        watch = self
        samplers = self.bookkeeping["the script check's DistributedSampler watch"]

        def make_sampler_init(original):
            def __init__(sampler, *args, **kwargs):
                original(sampler, *args, **kwargs)
                with samplers:
                    watch._sampler_sites[sampler] = caller_location()

            return __init__

        def make_set_epoch(original):
            def set_epoch(sampler, epoch):
                with samplers:
                    watch._set_epoch_calls[sampler] = watch._set_epoch_calls.get(sampler, 0) + 1
                return original(sampler, epoch)

            return set_epoch

        patches.wrap(DistributedSampler, "__init__", make_sampler_init)
        patches.wrap(DistributedSampler, "set_epoch", make_set_epoch)


    def _install_mode(self, patches: Patches) -> None:
        watch = self
        modes = self.bookkeeping["the script check's train/eval watch"]

        def make_train(original):
            def train(module, mode=True):
                if not watch._switching_mode:
                    with modes:
                        site = caller_location()
                        for inner in module.modules():
                            if mode:
                                watch._eval_sites.pop(inner, None)
                            else:
                                watch._eval_sites[inner] = site
                watch._switching_mode += 1
                try:
                    return original(module, mode)
                finally:
                    watch._switching_mode -= 1

            return train

        patches.wrap(nn.Module, "train", make_train)

    def _install_update_calls(self, patches: Patches) -> None:
        """Clipping and schedulers change an update after DDP averaged it: note who called them, where."""
        import torch.nn.utils as nn_utils
        import torch.nn.utils.clip_grad as clip_grad
        from torch.optim import lr_scheduler

        watch = self

        def noting(what: str):
            def make(original):
                def call(*args, **kwargs):
                    watch._note_call(what)
                    return original(*args, **kwargs)

                return call

            return make

        for name in ("clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_"):
            original = getattr(clip_grad, name, None)
            if original is None:
                continue
            wrapped = functools.wraps(original)(noting(name)(original))
            for owner in (nn_utils, clip_grad):
                if getattr(owner, name, None) is original:
                    patches.replace(owner, name, wrapped)
        patches.wrap(lr_scheduler.LRScheduler, "step", noting("scheduler.step"))
        if "step" in vars(lr_scheduler.ReduceLROnPlateau):  # its own step, not LRScheduler's
            patches.wrap(lr_scheduler.ReduceLROnPlateau, "step", noting("scheduler.step"))

    def _install_backward(self, patches: Patches) -> None:
        import torch.autograd

        watch = self
        original = torch.autograd.backward

        @functools.wraps(original)
        def backward(tensors, *args, **kwargs):
            watch._backward(tensors)
            return original(tensors, *args, **kwargs)

        patches.replace(torch.autograd, "backward", backward)  # Tensor.backward calls it through the module

    # -- what ScriptCheck tells it -----------------------------------------------------------

    @_never_raises(list)
    def ddp_built(self, ddp: Any) -> list[str]:
        """The parameter names in the order DDP pairs them across ranks (its buckets go by position)."""
        if not self.moments.models and not torch.is_anomaly_enabled():
            # Until the first backward, autograd keeps each node's forward traceback, so a loss
            # divided by the world size is named at the division's own line: one step's cost.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # its "will increase the runtime" is ours to pay, not news
                torch.autograd.set_detect_anomaly(True, check_nan=False)
            self._tracing_graph = True
        return [name for name, _ in ddp.module.named_parameters()]

    @_never_raises(dict)
    def forward_starts(self, ddp: Any) -> dict[str, Any]:
        """Extra fields for the forward's entry: eval-mode submodules, generator states before it."""
        return {**self._modes(ddp), "rng_before": generator_states()}

    def _modes(self, ddp: Any) -> dict[str, Any]:
        """The submodules of a DDP model in eval mode, and the line that put the first one there."""
        evaluating = [(name, module) for name, module in ddp.module.named_modules() if not module.training]
        if not ddp.training:
            evaluating.insert(0, ("(the DDP wrapper)", ddp))
        return {
            "eval_modules": [name or "(the model)" for name, _ in evaluating[:EVAL_NAMES]],
            "eval_count": len(evaluating),
            "eval_site": self._eval_sites.get(evaluating[0][1]) if evaluating else None,
        }

    @_never_raises()
    def forward_ends(self, entry: dict[str, Any] | None) -> None:
        if entry is not None:
            entry["rng_after"] = generator_states()

    def _stepped_parameters(self, optimizer: Any) -> list[torch.nn.Parameter]:
        """The parameters of DDP models that `optimizer` steps: the ones averaged alike on every rank."""
        return [p for group in optimizer.param_groups for p in group["params"] if id(p) in self.moments.ddp_parameters]

    @_never_raises()
    def step_starts(self, optimizer: Any, step: int) -> None:
        self._stop_tracing_graph()  # a step without a backward seen (autograd.grad, a closure)
        index = self._optimizers.setdefault(optimizer, len(self._optimizers))
        calls, self._calls = self._calls, []
        if len(self.steps) >= MAX_RECORDS:
            return
        parameters = self._stepped_parameters(optimizer)
        record = {
            "step": step,
            "optimizer": index,
            "site": caller_location(),
            "hyperparameters": hyperparameters(optimizer),
            "grads": tensors_fingerprint(p.grad for p in parameters if p.grad is not None),
            "params_before": tensors_fingerprint(parameters),
            "calls": calls,
            # Per step too: a rank that put the DDP wrapper itself in eval mode has no training forwards to compare.
            "modes": [self._modes(ddp) for ddp in self.moments.models],
        }
        self.steps.append(record)
        self._open_step[index] = record

    @_never_raises()
    def step_ends(self, optimizer: Any) -> None:
        record = self._open_step.pop(self._optimizers.get(optimizer, -1), None)
        if record is not None:
            parameters = self._stepped_parameters(optimizer)
            record["params_after"] = tensors_fingerprint(parameters)
        self.backwards_per_step.append(self._backwards)
        self._backwards = 0

    # -- recording ---------------------------------------------------------------------------

    @_never_raises()
    def _seeded(self, generator: str, value: Any) -> None:
        if len(self.seeds) < MAX_RECORDS:
            self.seeds.append({"generator": generator, "site": caller_location(), "after_ddp": bool(self.moments.models),
                               "forwards_before": self.moments.forwards, "value": repr(value)[:40]})

    def set_epoch_calls(self, sampler: DistributedSampler) -> int:
        return self._set_epoch_calls.get(sampler, 0)

    @_never_raises()
    def loader_pass(self, loader: Any, entry: dict[str, Any]) -> None:
        """A pass of a DataLoader starts: follow the sample indices it draws, and the generators its
        dataset holds when workers copy it."""
        self._follow_draws(loader, entry)
        if not loader.num_workers or len(self.worker_copies) >= MAX_RECORDS:
            return
        generators = dataset_generators(loader.dataset)
        if generators:
            self.worker_copies.append({
                "loader": entry["key"], "site": entry["site"], "workers": loader.num_workers,
                "worker_init_fn": loader.worker_init_fn is not None,
                "generators": {path: generator_state(g) for path, g in generators.items()},
                "created_at": {path: self._generator_sites.get(id(g)) for path, g in generators.items()},
            })

    @_never_raises()
    def iterator_made(self, iterator: Any) -> None:
        """The pass's iterator exists: the indices it draws from now on go to the pass started last."""
        if self._starting is not None:
            self._draws[iterator] = self._starting
            self._starting = None

    def _follow_draws(self, loader: Any, entry: dict[str, Any]) -> None:
        """The dataset indices a pass draws (mapped through Subset to the dataset underneath), for
        the launcher to compare the ranks' shares. Not for an IterableDataset (no indices), nor
        for a sampler that draws with replacement (shares overlap by design)."""
        self._starting = None
        sampler = index_sampler(loader)
        passes = self._passes[entry["key"]] = self._passes.get(entry["key"], 0) + 1
        if (
            passes > INDEXED_PASSES
            or len(self.loader_draws) >= MAX_RECORDS
            or isinstance(loader.dataset, torch.utils.data.IterableDataset)
            or getattr(sampler, "replacement", False)
        ):
            return
        dataset, chain = loader.dataset, []
        while isinstance(dataset, Subset):
            chain.append(dataset.indices)
            dataset = dataset.dataset
        try:
            size = len(dataset)
        except TypeError:
            return
        record: dict[str, Any] = {"loader": entry["key"], "site": entry["site"], "pass": passes, "dataset_size": size,
                                  "over_subset": bool(chain), "complete": False, "indices": [], "sampler": None}
        if isinstance(sampler, DistributedSampler):
            record["sampler"] = {"site": self._sampler_sites.get(sampler), "epoch": sampler.epoch, "seed": sampler.seed,
                                 "rank": sampler.rank, "num_replicas": sampler.num_replicas,
                                 "total_size": sampler.total_size}
        self.loader_draws.append(record)
        self._starting = (record, chain)

    @_never_raises()
    def drew(self, iterator: Any, index: Any) -> None:
        """The DataLoader's iterator took the next index (or batch of indices) of its pass."""
        followed = self._draws.get(iterator) or self._starting
        if followed is None:
            return
        record, chain = followed
        if index is None:  # the pass is over
            record["complete"] = True
            return
        for i in index if isinstance(index, (list, tuple)) else [index]:
            if len(record["indices"]) >= MAX_INDICES:
                self._draws.pop(iterator, None)
                self._starting = None
                record["indices"] = None  # too many to compare
                return
            for indices in chain:
                i = indices[i]
            record["indices"].append(int(i))

    @_never_raises()
    def _note_call(self, what: str) -> None:
        if len(self._calls) < CALLS_PER_STEP:
            self._calls.append({"what": what, "site": caller_location()})

    def _stop_tracing_graph(self) -> None:
        if self._tracing_graph:
            torch.autograd.set_detect_anomaly(False)
            self._tracing_graph = False

    @_never_raises()
    def _backward(self, tensors: Any) -> None:
        self._backwards += 1
        try:
            self._walk_loss(tensors)
        finally:
            self._stop_tracing_graph()

    def _walk_loss(self, tensors: Any) -> None:
        if not self.moments.models or len(self.loss_walks) >= LOSS_WALKS:
            return
        loss = tensors if isinstance(tensors, torch.Tensor) else None
        if loss is None and isinstance(tensors, (list, tuple)) and len(tensors) == 1:
            loss = tensors[0]
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or loss.grad_fn is None:
            return
        try:
            normalisation = loss_normalisation(loss)
        except (RuntimeError, TypeError, ValueError):  # a graph whose saved values cannot be read
            normalisation = None
        self.loss_walks.append({"site": caller_location(), "step": self.moments.steps + 1, **(normalisation or {"scale": None})})

    def facts(self) -> dict[str, Any]:
        return {
            "seeds": self.seeds,
            "loader_draws": self.loader_draws,
            "worker_copies": self.worker_copies,
            "steps_taken": self.steps,
            "loss_walks": self.loss_walks,
            "backwards_per_step": self.backwards_per_step,
            "watch_failures": self.bookkeeping.failures(),
        }
