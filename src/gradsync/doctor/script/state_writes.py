"""One state everywhere: every rank's training state agrees at each step, and a write that broke it is named.

Data-parallel training keeps one state on every rank: the parameters and buffers, the optimizer's
settings (every param_group entry) and its per-parameter state, the GradScaler's scale and the LR
schedulers' state. The optimizer's step and DDP's own synchronisation keep it so; a write made
beside them, on some ranks only or with a value that differs by rank, splits it silently:
a checkpoint or optimizer state restored on rank 0 after DDP broadcast the weights, a
ReduceLROnPlateau fed each rank's own validation loss. Nothing fails; the replicas train on.

So each rank records, going into every counted optimizer step, a fingerprint of each part of its
state, and every write to that state made outside the step: `load_state_dict` of a module, an
optimizer, a GradScaler or a scheduler, a scheduler's step (with what it left in the optimizer),
and a parameter, buffer or submodule of a wrapped model replaced after DDP was built. The rule
finds the first step where a part differs across ranks (what differs first, and when: between
DDP's construction and the first step, or after step k), and blames the write before it that
only some ranks made, or that every rank made with a different result; a replacement after
wrapping is reported on its own, since DDP keeps synchronising the tensors it was given.

Cost: a sampled fingerprint (a few hundred values per tensor) of the stepped parameters and of
the optimizer's state per step, for the first MAX_RECORDS steps; a write is recorded once per
line and target.
"""

from __future__ import annotations

import weakref
import zlib
from typing import Any, TypedDict

import torch
from torch import nn

from gradsync.rundir.records import Finding
from gradsync.callsite import caller_location
from gradsync.run.check_primitives import Patches, dtensor_class, hyperparameters, tensor_fingerprint, tensors_fingerprint
from gradsync.run.harmless import BookkeepingByKind
from gradsync.doctor.script.compare import odd_ones_out, ranks_text, settings_differ
from gradsync.run.moments import Moments
from gradsync.run.tensor_writes import COMPANION
from gradsync.doctor.script.shared_facts import own_facts
from gradsync.doctor.script.unit import Category, Check, RankFacts

NAME = "state_writes"
COMPANIONS = "companions"  # the state of the modules run beside the wrapped ones, compared on its own
MAX_RECORDS = 64  # steps whose state is fingerprinted, and writes kept, per rank
_PLAIN = (bool, int, float, str, type(None))

# The parts of the state compared at each step, in the order "what differs first" names them.
PARTS = {
    "parameters": "the parameters",
    "trainable": "which parameters train (requires_grad)",
    "gradients": "the averaged gradients",  # compared after a synchronised backward only
    "hyperparameters": "the optimizer's settings",
    "optimizer_state": "the optimizer's per-parameter state",
    "scalers": "the GradScaler's state",
    "schedulers": "the LR scheduler's state",
}
# What each kind of write changes: the parts a difference must be in for the write to explain it.
WRITES = {
    "Module.load_state_dict": ("parameters",),
    "Optimizer.load_state_dict": ("hyperparameters", "optimizer_state"),
    "GradScaler.load_state_dict": ("scalers",),
    "scheduler.load_state_dict": ("schedulers", "hyperparameters"),
    "scheduler.step": ("schedulers", "hyperparameters"),
}
# What a tensor-level write changes (gradsync.run.tensor_writes), by the part of the state it touched.
TENSOR_WRITES = {
    "parameter": ("parameters", "trainable", "gradients"),  # a parameter's values or its requires_grad
    "gradient": ("gradients",),
    COMPANION: (COMPANIONS,),
}
RESULTS_KEPT = 4  # what the first writes of a line to a companion's state left, per step window
WRITES_PER_STEP = 16  # distinct tensor writes (op, line, part) kept per step window


def _crc(text: str) -> int:
    return zlib.crc32(text.encode())


def _plain_state(state: dict[str, Any]) -> str:
    """The numbers and words of a state_dict, as one comparable text (functions and objects left out:
    their repr holds addresses)."""
    items = []
    for key, value in sorted(state.items()):
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, _PLAIN) or (isinstance(value, (list, tuple)) and all(isinstance(v, _PLAIN) for v in value)):
            items.append(f"{key}={value!r}")
    return "; ".join(items)


def optimizer_state_fingerprint(optimizer: Any) -> int | None:
    """One fingerprint of the per-parameter state (moments, step counts) in param_groups order.

    The state of a sharded parameter (a DTensor: FSDP2, tensor parallelism) is left out: its
    shards differ across ranks by design, and reading it whole would be a collective."""
    dtensor = dtensor_class()
    combined = 0
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            if dtensor is not None and isinstance(parameter, dtensor):
                continue
            for key, value in sorted(optimizer.state.get(parameter, {}).items()):
                if dtensor is not None and isinstance(value, dtensor):
                    continue
                part = tensor_fingerprint(value) if isinstance(value, torch.Tensor) else _crc(repr(value))
                if part is None:
                    return None
                combined = zlib.crc32(f"{key}{part}".encode(), combined)
    return combined


class StateFacts(TypedDict):
    """What the watch records on one rank (under "state_writes" in its facts file)."""

    steps: list[dict[str, Any]]  # per step: fingerprints of each part of the state going into it
    # companion key -> where its parameters were made, and the names of its tensors (a few)
    companions: dict[str, dict[str, Any]]
    writes: list[dict[str, Any]]  # writes beside the step: what, target, line, step, their effects
    # per step window (the counted steps before it, as text): the tensor-level writes made in it
    # (op, kinds, names, line, the plain numbers given, how many times), in the order first made
    tensor_writes: dict[str, list[dict[str, Any]]]


class StateWatch:
    """The state going into each step and the writes beside the step, on one rank."""

    def __init__(self, moments: Moments, bookkeeping: BookkeepingByKind) -> None:
        self.moments = moments
        self.bookkeeping = bookkeeping[f"the {NAME} check's watch"]
        self.steps: list[dict[str, Any]] = []
        self.writes: list[dict[str, Any]] = []
        self._written: dict[tuple[str, str | None, str], dict[str, Any]] = {}  # (what, site, target) -> its record
        self._optimizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # -> index
        self._scalers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # -> index, in the order first seen
        self._schedulers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # a module inside a DDP model -> its name there (weakly: a dead module's id is reused)
        self._wrapped_modules: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._inside: int = 0  # load_state_dict calls in progress (they set attributes of their own)
        self.tensor_writes: dict[str, list[dict[str, Any]]] = {}
        self.companions: dict[str, dict[str, Any]] = {}
        self._reductions_before = 0  # DDP's synchronised backward passes at the previous step
        moments.on("wrapped", self._wrapped, self.bookkeeping)
        moments.on("step_starts", self._step_starts, self.bookkeeping)
        moments.on("state_written", self._state_written, self.bookkeeping)

    # -- installing --------------------------------------------------------------------------

    def install(self, patches: Patches) -> None:
        from torch.amp import GradScaler
        from torch.optim import Optimizer, lr_scheduler

        self._patch_write(patches, nn.Module, "load_state_dict", "Module.load_state_dict", self._module_loaded)
        self._patch_write(patches, Optimizer, "load_state_dict", "Optimizer.load_state_dict", self._optimizer_loaded)
        self._patch_write(patches, GradScaler, "load_state_dict", "GradScaler.load_state_dict", self._scaler_seen)
        for scheduler_class in {lr_scheduler.LRScheduler, lr_scheduler.ReduceLROnPlateau}:
            for method in ("load_state_dict", "step"):
                if method in vars(scheduler_class):
                    self._patch_write(patches, scheduler_class, method, f"scheduler.{method}", self._scheduler_written)
        for method in ("scale", "update"):  # the scalers in use, in the order the script uses them
            patches.wrap(GradScaler, method, self._seeing(self._scaler_seen))
        patches.wrap(nn.Module, "__setattr__", self._make_setattr)

    def _patch_write(self, patches: Patches, owner: type, method: str, what: str, effect: Any) -> None:
        watch = self

        def make(original):
            def write(target, *args, **kwargs):
                watch._inside += 1
                try:
                    result = original(target, *args, **kwargs)
                finally:
                    watch._inside -= 1
                with watch.bookkeeping:
                    if not watch._inside:  # a scheduler's load or step calling another's: the outer one is the write
                        watch._wrote(what, target, effect(target), args)
                return result

            return write

        patches.wrap(owner, method, make)

    def _seeing(self, remember: Any) -> Any:
        watch = self

        def make(original):
            def call(target, *args, **kwargs):
                with watch.bookkeeping:
                    remember(target)
                return original(target, *args, **kwargs)

            return call

        return make

    def _make_setattr(self, original: Any) -> Any:
        watch = self

        def __setattr__(module, name, value):
            # The fast path first: this runs on every attribute a module sets.
            if watch._wrapped_modules and not watch._inside:
                with watch.bookkeeping:  # a module class may be unhashable (__eq__ without __hash__)
                    if module in watch._wrapped_modules:
                        watch._replacing(module, name, value)
            return original(module, name, value)

        return __setattr__

    # -- the moments -------------------------------------------------------------------------

    def _wrapped(self, ddp: Any, site: str | None) -> None:
        for name, module in ddp.module.named_modules():
            self._wrapped_modules[module] = name

    def _step_starts(self, optimizer: Any, step: int) -> None:
        index = self._optimizers.setdefault(optimizer, len(self._optimizers))
        if len(self.steps) >= MAX_RECORDS:
            return
        going_in = self.moments.going_in(optimizer)
        stepped = self.moments.stepped_parameters(optimizer)
        # An averaged gradient is the same on every rank: compared only after DDP reduced in this step.
        synced, self._reductions_before = self.moments.reductions > self._reductions_before, self.moments.reductions
        self.steps.append({
            "step": step,
            "optimizer": index,
            "site": caller_location(),
            "parameters": going_in["parameters"],
            "trainable": _crc("".join("1" if p.requires_grad else "0" for p in stepped)) if stepped else None,
            "gradients": tensors_fingerprint(p.grad for p in stepped if p.grad is not None) if synced else None,
            "hyperparameters": going_in["hyperparameters"],
            "optimizer_state": optimizer_state_fingerprint(optimizer),
            "scalers": [_plain_state(s.state_dict()) for s in self._in_order(self._scalers)],
            "schedulers": [_crc(_plain_state(s.state_dict())) for s in self._in_order(self._schedulers)],
            COMPANIONS: self._companions_going_in(),
        })

    def _companions_going_in(self) -> dict[str, list[int | None]]:
        """Companion key -> fingerprints of its parameters and of its buffers."""
        found = {}
        for state in self.moments.companion_states():
            if state.key not in self.companions and len(self.companions) < MAX_RECORDS:
                made = next((site for site in map(self.moments.created_at, (p for _, p in state.parameters)) if site), None)
                self.companions[state.key] = {"created": made, "names": [name for name, _ in (*state.parameters, *state.buffers)][:4]}
            found[state.key] = [tensors_fingerprint(p for _, p in state.parameters),
                                tensors_fingerprint(b for _, b in state.buffers)]
        return found

    # -- the writes --------------------------------------------------------------------------

    @staticmethod
    def _in_order(seen: weakref.WeakKeyDictionary) -> list[Any]:
        return [thing for thing, _ in sorted(seen.items(), key=lambda item: item[1])]

    def _scaler_seen(self, scaler: Any) -> str:
        self._scalers.setdefault(scaler, len(self._scalers))
        return _plain_state(scaler.state_dict())

    def _module_loaded(self, module: nn.Module) -> str:
        return str(tensors_fingerprint(module.parameters()))

    def _optimizer_loaded(self, optimizer: Any) -> str:
        return f"{hyperparameters(optimizer)} | {optimizer_state_fingerprint(optimizer)}"

    def _scheduler_written(self, scheduler: Any) -> str:
        """What a scheduler's write leaves: its state, and its optimizer's settings."""
        self._schedulers.setdefault(scheduler, len(self._schedulers))
        return f"{_plain_state(scheduler.state_dict())} | {hyperparameters(scheduler.optimizer)}"

    def _wrote(self, what: str, target: Any, effect: str, args: tuple) -> None:
        site = caller_location()
        key = (what, site, type(target).__name__)
        record = self._written.get(key)
        if record is not None and record["step"] == self.moments.steps:
            record["effects"].append(_crc(effect))  # the same line again in this step (a scheduler per micro-step)
            return
        if len(self.writes) >= MAX_RECORDS:
            return
        argument = args[0] if args and what == "scheduler.step" else None
        record = {
            "what": what,
            "target": type(target).__name__,
            "site": site,
            "step": self.moments.steps,  # counted steps before it: it is a write before step `step + 1`
            "after_wrap": bool(self.moments.models),
            "effects": [_crc(effect)],
            "argument": repr(float(argument)) if isinstance(argument, (int, float, torch.Tensor)) and _is_scalar(argument) else None,
        }
        self._written[key] = record
        self.writes.append(record)

    def _state_written(self, write: Any) -> None:
        """A tensor-level write (gradsync.run.tensor_writes.StateWrite), kept per step window by
        what it did and where: the same line in the same window is one entry, counted."""
        if not (self.moments.models or self.moments.sharded):
            return  # before DDP was built: its broadcast evens the parameters out
        window = str(self.moments.steps)
        if window not in self.tensor_writes and len(self.tensor_writes) >= MAX_RECORDS:
            return
        entries = self.tensor_writes.setdefault(window, [])
        for entry in entries:
            if (entry["op"], entry["site"], entry["kinds"]) == (write.op, write.site, list(write.kinds)):
                entry["count"] += 1
                if write.scalars and len(entry["scalars"]) < 4 and list(write.scalars) not in entry["scalars"]:
                    entry["scalars"].append(list(write.scalars))
                if write.result is not None and len(entry["results"]) < RESULTS_KEPT:
                    entry["results"].append(write.result)
                return
        if len(entries) < WRITES_PER_STEP:
            entries.append({"op": write.op, "site": write.site, "kinds": list(write.kinds), "names": list(write.names),
                            "scalars": [list(write.scalars)] if write.scalars else [], "count": 1,
                            "in_forward": write.forwarding, "sharded": write.sharded, "loop_site": write.loop_site,
                            "results": [write.result] if write.result is not None else []})

    def _replacing(self, module: nn.Module, name: str, value: Any) -> None:
        # Buffers are not watched: DDP collects the module's buffers anew before each sync
        # (pytorch#63916), so a buffer assigned anew in the forward is synchronised like any other.
        if name in module._parameters:
            kind = "parameter"
        elif name in module._modules and isinstance(value, nn.Module):
            kind = "submodule"
        else:
            return
        prefix = self._wrapped_modules[module]
        target = f"{prefix}.{name}" if prefix else name
        site = caller_location()
        key = ("replaced", site, target)
        record = self._written.get(key)
        if record is not None:
            record["times"] += 1
            return
        if len(self.writes) >= MAX_RECORDS:
            return
        record = {"what": "replaced", "kind": kind, "target": target, "site": site, "step": self.moments.steps,
                  "after_wrap": True, "in_forward": self.moments.forwarding > 0, "times": 1, "effects": []}
        self._written[key] = record
        self.writes.append(record)

    def facts(self) -> StateFacts:
        return {"steps": self.steps, "writes": self.writes, "tensor_writes": self.tensor_writes, "companions": self.companions}


def _is_scalar(value: Any) -> bool:
    return not isinstance(value, torch.Tensor) or value.numel() == 1


# -- the rule -----------------------------------------------------------------------------------


def state_findings(checks: RankFacts) -> list[Finding]:
    recorded = own_facts(checks, NAME)
    if recorded is None:
        return []
    return [*_replaced_after_wrapping(recorded), *(_written_on_some_ranks(recorded) or _sharded_writes_differ(recorded)),
            *_companion_apart(recorded)]


def _first_difference(recorded: dict[int, dict[str, Any]]) -> tuple[int, list[str], dict[int, dict[str, Any]]] | None:
    """(step, the parts that differ going into it, rank -> its record) at the first step where the
    ranks' state differs."""
    by_step: dict[tuple[int, int], dict[int, dict[str, Any]]] = {}
    for rank, facts in recorded.items():
        for record in facts["steps"]:
            by_step.setdefault((record["step"], record["optimizer"]), {})[rank] = record
    for (step, _), by_rank in sorted(by_step.items()):
        if len(by_rank) != len(recorded):
            continue
        parts = [part for part in PARTS
                 if all(r.get(part) is not None for r in by_rank.values()) and len({repr(r.get(part)) for r in by_rank.values()}) > 1]
        if parts:
            return step, parts, by_rank
    return None


def _written_on_some_ranks(recorded: dict[int, dict[str, Any]]) -> list[Finding]:
    first = _first_difference(recorded)
    if first is None:
        return []
    step, parts, by_rank = first
    # The writes at the entry points come first: a state loaded on some ranks (a GradScaler's) makes
    # the tensor writes that read it differ too (its unscale, with another scale), as consequences.
    return _entry_point_write(recorded, step, parts, by_rank) or _tensor_write(recorded, step, parts, by_rank)


def _tensor_write(recorded: dict[int, dict[str, Any]], step: int, parts: list[str],
                  by_rank: dict[int, dict[str, Any]]) -> list[Finding]:
    diverging = _diverging_tensor_write(recorded, step, parts)
    if diverging is None:
        return []
    opening = f"{_parts_text(parts, by_rank)} {_differ(parts)} across ranks"
    return [_tensor_write_finding(step, opening, sorted(recorded), parts, *diverging)]


def _one_sided(by_rank: dict[int, list[dict[str, Any]]], key: Any) -> tuple[set[Any], dict[int, dict[str, Any]]]:
    """The writes every rank made (by `key`: what and where), and per rank its first write that not
    every rank made."""
    keys = {rank: {key(w) for w in ws} for rank, ws in by_rank.items()}
    everyone = set.intersection(*keys.values())
    return everyone, {rank: next(w for w in ws if key(w) not in everyone) for rank, ws in by_rank.items() if keys[rank] - everyone}


def _entry_point_write(recorded: dict[int, dict[str, Any]], step: int, parts: list[str],
                       by_rank: dict[int, dict[str, Any]]) -> list[Finding]:
    # The writes before that step that can change what differs, per rank, by line and kind.
    writes = {rank: [w for w in facts["writes"] if w["what"] in WRITES and w["step"] < step and set(WRITES[w["what"]]) & set(parts)]
              for rank, facts in recorded.items()}
    everyone, one_sided = _one_sided(writes, lambda w: (w["what"], w["site"]))
    if one_sided:
        ranks = sorted(one_sided)
        write = one_sided[ranks[0]]
        cause = (f"{ranks_text(ranks)} called {write['what']} at {write['site'] or '?'}"
                 f"{' after DDP was built' if write['after_wrap'] else ''}, and the other ranks did not")
    else:
        different = _same_write_different_result(writes, everyone)
        if different is None:
            return []
        ranks, write, arguments = different
        cause = (f"every rank called {write['what']} at {write['site'] or '?'}, and it left a different state on "
                 f"{ranks_text(ranks)}" + (f": it was given {arguments}, a value each rank computed on its own "
                                             "(its own share of the validation data)" if arguments else ""))
    locations = {str(rank): (one_sided.get(rank) or write)["site"] or "?" for rank in ranks}
    when = ("between DDP's construction and the first step" if step == 1 and write["after_wrap"]
            else "before the first step" if step == 1 else f"after step {step - 1}")
    return [Finding(
        "state_written_on_some_ranks",
        "error",
        ranks,
        f"Going into optimizer step {step}, {_parts_text(parts, by_rank)} {_differ(parts)} "
        "across ranks: the state first "
        f"parted {when}. {cause[0].upper()}{cause[1:]}. The ranks now train different models from one averaged "
        "gradient, and a checkpoint saved by rank 0 holds only rank 0's.",
        "Make every write to the training state on every rank, with the same value: load a checkpoint on every "
        "rank (or load it on rank 0 before DDP is built, which then broadcasts the weights; the optimizer, "
        "GradScaler and scheduler state are never broadcast: load them on every rank, or send them with "
        "dist.broadcast_object_list); feed a scheduler a metric all-reduced across ranks.",
        locations=locations,
        step=step,
        details={"differs": parts, "write": write["what"]},
    )]


def _relevant(write: dict[str, Any], parts: list[str], prefix: str | None = None) -> bool:
    return bool(set(parts) & {part for kind in write["kinds"] for part in TENSOR_WRITES.get(kind, ())}) and (
        prefix is None or any(name.startswith(prefix) for name in write["names"]))


def _diverging_tensor_write(recorded: dict[int, dict[str, Any]], step: int, parts: list[str]
                            ) -> tuple[int, dict[int, dict[str, Any]], str, list[int]] | None:
    """Differential execution: (window, rank -> its write, how, the ranks to blame) for the latest step window before
    `step` in which the ranks did not make the same tensor-level writes to the parts that differ."""
    found = _first_window_difference(recorded, range(step - 1, -1, -1), parts)
    return (found[0], *found[1]) if found is not None else None


def _first_window_difference(recorded: dict[int, dict[str, Any]], windows: Any, parts: list[str], prefix: str | None = None
                             ) -> tuple[int, tuple[dict[int, dict[str, Any]], str, list[int]]] | None:
    """(window, what _window_difference found there) for the first of `windows`, in their order,
    whose writes differ across ranks."""
    return next(((window, found) for window in windows
                 if (found := _window_difference(recorded, window, parts, prefix)) is not None), None)


def _window_difference(recorded: dict[int, dict[str, Any]], window: int, parts: list[str], prefix: str | None = None
                       ) -> tuple[dict[int, dict[str, Any]], str, list[int]] | None:
    """(rank -> its write, how, the ranks to blame) where the ranks' tensor-level writes to the
    parts in one step window differ: a line some ranks ran and the others did not ("made"), or ran
    a different number of times ("times"), with other numbers ("numbers"), or leaving a companion's
    state different ("results"). Ranks run the same code: a state-changing line only some run, or
    run with values of their own, is where their states part."""
    by_rank = {rank: [w for w in facts.get("tensor_writes", {}).get(str(window), []) if _relevant(w, parts, prefix)]
               for rank, facts in recorded.items()}
    everyone, one_sided = _one_sided(by_rank, lambda w: (w["op"], w["site"]))
    if one_sided:
        return one_sided, "made", sorted(one_sided)
    for op, site in [(w["op"], w["site"]) for w in by_rank[min(by_rank)] if (w["op"], w["site"]) in everyone]:
        same = {rank: next(w for w in ws if (w["op"], w["site"]) == (op, site)) for rank, ws in by_rank.items()}
        for how, field in (("times", "count"), ("numbers", "scalars"), ("results", "results")):
            values = {rank: repr(w.get(field)) for rank, w in same.items()}
            if len(set(values.values())) > 1:
                return same, how, odd_ones_out(values)
    return None


def _sharded_writes_differ(recorded: dict[int, dict[str, Any]]) -> list[Finding]:
    """Writes to sharded gradients or parameters (FSDP2, tensor parallelism) that the ranks did not
    make alike. Their shards differ by design, so no fingerprint can show the state parting; but a
    number applied to every shard (a clipping coefficient, a loss scale) must be the same on every
    rank, or each shard of one model is scaled its own way."""
    for window in _windows(recorded):
        sharded = {rank: [w for w in facts.get("tensor_writes", {}).get(str(window), []) if w.get("sharded")]
                   for rank, facts in recorded.items()}
        if not any(sharded.values()):
            continue
        parts = sorted({part for ws in sharded.values() for w in ws for kind in w["kinds"] for part in TENSOR_WRITES.get(kind, ())})
        found = _diverging_tensor_write({rank: {"tensor_writes": {str(window): ws}} for rank, ws in sharded.items()},
                                        window + 1, parts)
        if found is not None:
            opening = "the sharded state (FSDP2 or tensor parallelism: each rank holds its own shards, so no fingerprint compares them) was not written alike"
            return [_tensor_write_finding(window + 1, opening, sorted(recorded), parts, *found)]
    return []


def _tensor_write_finding(step: int, opening: str, ranks_all: list[int], parts: list[str], window: int,
                          writes: dict[int, dict[str, Any]], how: str, blamed: list[int]) -> Finding:
    ranks = sorted(writes)
    write = writes[blamed[0]]
    target = f"{' and '.join(sorted(set(write['kinds'])))} {', '.join(write['names'][:3])}".strip()
    when = "before the first step" if window == 0 else f"after step {window}"
    if how == "made":
        others = sorted(set(ranks_all) - set(ranks))
        cause = (f"{ranks_text(ranks)} ran `{write['op']}` on the {target} at {write['site'] or '?'} {when}, and "
                 f"{ranks_text(others) if others else 'the other ranks'} did not")
    else:
        said = ", ".join(f"rank {rank} {_said(w, how)}" for rank, w in sorted(writes.items()))
        cause = (f"every rank ran `{write['op']}` on the {target} at {write['site'] or '?'} {when}, "
                 f"{'a different number of times' if how == 'times' else 'with numbers of its own'} ({said})")
    return Finding(
        "state_written_on_some_ranks",
        "error",
        blamed,
        f"Going into optimizer step {step}, {opening}: {cause}. Ranks run the same code; a write to the training "
        "state that only some make, or "
        "make with values of their own, leaves them training different models from one averaged gradient.",
        "Make every write to the training state on every rank, with the same values: no `if rank == 0:` around "
        "changes to parameters, gradients or requires_grad (only logging and saving belong there), and values "
        "that enter them computed from numbers every rank shares (all-reduce a rank's own count or norm first).",
        locations={str(rank): writes[rank]["site"] or "?" for rank in blamed},
        step=step,
        details={"differs": parts, "write": write["op"], "how": how, "window": window},
    )


def _said(write: dict[str, Any], how: str) -> str:
    if how == "times":
        return f"{write['count']} time{'s' if write['count'] != 1 else ''}"
    return ", ".join(" ".join(numbers) for numbers in write["scalars"]) or "none"


def _same_write_different_result(writes: dict[int, list[dict[str, Any]]], everyone: set[tuple[str, str]]
                                 ) -> tuple[list[int], dict[str, Any], str] | None:
    """(ranks, the write, its arguments in words) for the first write every rank made at the same
    line whose result differs across ranks."""
    ordered = {rank: [w for w in ws if (w["what"], w["site"]) in everyone] for rank, ws in writes.items()}
    for index in range(min(len(ws) for ws in ordered.values())):
        same = {rank: ws[index] for rank, ws in ordered.items()}
        if len({(w["what"], w["site"]) for w in same.values()}) != 1:
            return None
        length = min(len(w["effects"]) for w in same.values())
        results = {rank: tuple(w["effects"][:length]) for rank, w in same.items()}
        if len(set(results.values())) > 1:
            ranks = odd_ones_out(results)
            arguments = {rank: w["argument"] for rank, w in same.items()}
            said = (", ".join(f"rank {r} {a}" for r, a in sorted(arguments.items()))
                    if None not in arguments.values() and len(set(arguments.values())) > 1 else "")
            return ranks, same[ranks[0]], said
    return None


def _first_companion_difference(recorded: dict[int, dict[str, Any]]) -> tuple[int, int, str, list[str]] | None:
    """(the step, the step it was first compared at, its key, what differs: "parameters" and/or
    "buffers") for the first companion whose state differs across ranks going into a step."""
    by_step: dict[int, dict[int, dict[str, Any]]] = {}
    for rank, facts in recorded.items():
        for record in facts["steps"]:
            by_step.setdefault(record["step"], {}).setdefault(rank, record.get(COMPANIONS) or {})
    first_seen: dict[str, int] = {}
    for step, by_rank in sorted(by_step.items()):
        if len(by_rank) != len(recorded):
            continue
        lowest = by_rank[min(by_rank)]
        for key in [key for key in lowest if all(key in companions for companions in by_rank.values())]:
            first_seen.setdefault(key, step)
            differs = [what for index, what in enumerate(("parameters", "buffers"))
                       if len({repr(companions[key][index]) for companions in by_rank.values()}) > 1]
            if differs:
                return step, first_seen[key], key, differs
    return None


def _companion_apart(recorded: dict[int, dict[str, Any]]) -> list[Finding]:
    """A module the training step runs beside the wrapped model, whose state differs across ranks:
    named at the write that parted it (made on some ranks only, or leaving each rank's copy its
    own), else where its parameters were made apart, else at the update that keeps parting it,
    else at its call (it changed inside its own forward)."""
    first = _first_companion_difference(recorded)
    if first is None:
        return []
    step, first_seen, key, differs = first
    ranks_all = sorted(recorded)
    prefix = f"{key}: "
    module, _, called = key.partition(" called at ")
    info = recorded[ranks_all[0]].get("companions", {}).get(key, {})
    written = _first_window_difference(recorded, range(step - 1, first_seen - 2, -1), [COMPANIONS], prefix)
    if written is None and not ("parameters" in differs and step == first_seen and info.get("created")):
        later = [window for window in _windows(recorded) if window >= step]
        written = _first_window_difference(recorded, later, [COMPANIONS], prefix)
    if written is not None:
        window, (writes, how, blamed) = written
        write = writes[blamed[0]]
        where = write.get("loop_site") or write["site"] or "?"
        through = f" (the write itself at {write['site']})" if write.get("loop_site") and write["site"] != write["loop_site"] else ""
        # A write in a window before the difference parted it; one in a later window (the first
        # difference came from before the companion was known) is the update that keeps it apart.
        after = ("before the first step" if window == 0 else f"after step {window}") + (
            " (the first of its writes the doctor saw)" if window >= step else "")
        others = sorted(set(ranks_all) - set(blamed))
        if how == "made":
            cause = (f"{ranks_text(blamed)} ran `{write['op']}` on it at {where}{through} {after}, and "
                     f"{ranks_text(others) if others else 'the other ranks'} did not")
        else:
            cause = (f"every rank ran `{write['op']}` on it at {where}{through} {after}, leaving a different state on "
                     "each rank: it is updated from values each rank computes on its own (its own batch), never "
                     "averaged across ranks")
        locations = {str(rank): writes[rank].get("loop_site") or writes[rank]["site"] or "?" for rank in blamed}
    elif "parameters" in differs and info.get("created"):
        blamed = ranks_all
        cause = (f"its parameters were made at {info['created']} with different values on each rank (a seed of its own "
                 "per rank, or built before DDP broadcast rank 0's weights: DDP broadcasts only the model it wraps)")
        locations = {str(rank): info["created"] for rank in blamed}
    else:
        blamed = ranks_all
        cause = (f"no write the doctor saw made it so: it changed inside its own call at {called} (running statistics "
                 "of each rank's own batch: a BatchNorm in train mode)")
        locations = {str(rank): called for rank in blamed}
    names = ", ".join(info.get("names", [])[:3])
    return [Finding(
        "companion_apart",
        "warning",
        blamed,
        f"Going into optimizer step {step}, the {' and '.join(differs)} of `{module}`{f' ({names})' if names else ''}, a "
        f"module the training step runs at {called} beside the model DDP trains, differ across ranks"
        f"{'' if step == first_seen else f' (alike going into step {first_seen})'}: {cause}. DDP neither "
        "broadcasts nor averages it, so each rank trains against its own copy (its own teacher outputs, targets or "
        "normalisation) and rank 0's checkpoint holds only rank 0's.",
        "Build it alike on every rank (copy it from the wrapped model after DDP was built, or broadcast its state from "
        "rank 0: `for t in module.state_dict().values(): dist.broadcast(t, 0)`) and update it alike: on every rank, "
        "from values every rank shares (the wrapped model's parameters, statistics all-reduced across ranks). If "
        "each rank is meant to keep its own (a queue of its own negatives), nothing is wrong.",
        locations=locations,
        step=step,
        details={"companion": key, "differs": differs},
    )]


def _windows(recorded: dict[int, dict[str, Any]]) -> list[int]:
    """The step windows any rank recorded tensor writes in, in order."""
    return sorted({int(window) for facts in recorded.values() for window in facts.get("tensor_writes", {})})


_SINGULAR = {"trainable", "optimizer_state", "scalers", "schedulers"}  # PARTS named by a singular noun


def _differ(parts: list[str]) -> str:
    return "differs" if len(parts) == 1 and parts[0] in _SINGULAR else "differ"


def _parts_text(parts: list[str], by_rank: dict[int, dict[str, Any]]) -> str:
    said = [PARTS[part] for part in parts]
    if "hyperparameters" in parts:
        settings = settings_differ({rank: record["hyperparameters"] for rank, record in by_rank.items()})
        said[parts.index("hyperparameters")] += f" ({settings})"
    return ", ".join(said[:-1]) + (" and " if len(said) > 1 else "") + said[-1]


_REPLACED_WHY = {
    "parameter": "DDP hooks and buckets the parameters it was given at construction; the new one's gradient is never "
    "averaged, and it was never broadcast from rank 0, so each rank trains its own copy",
    "submodule": "DDP hooks and buckets the parameters it was given at construction; the new submodule's gradients "
    "are never averaged, and its weights were never broadcast from rank 0, so each rank trains its own copy",
}


def _replaced_after_wrapping(recorded: dict[int, dict[str, Any]]) -> list[Finding]:
    replaced = {rank: [w for w in facts["writes"] if w["what"] == "replaced"] for rank, facts in recorded.items()}
    replaced = {rank: ws for rank, ws in replaced.items() if ws}
    if not replaced:
        return []
    ranks = sorted(replaced)
    first = replaced[ranks[0]][0]
    targets = sorted({w["target"] for ws in replaced.values() for w in ws})
    where = (" in the forward" if first["in_forward"] else "") + (f", {first['times']} times" if first["times"] > 1 else "")
    return [Finding(
        "replaced_after_wrapping",
        "error",
        ranks,
        f"The {first['kind']} '{first['target']}' of the model wrapped in DDP was replaced after DDP was built, at "
        f"{first['site'] or '?'}{where}" + (f" ({len(targets)} replaced in all: {', '.join(targets[:5])})" if len(targets) > 1 else "")
        + f". {_REPLACED_WHY[first['kind']]}. Nothing fails.",
        "Finish building the model before wrapping it: replace heads and layers, add adapters (LoRA), or load a "
        "checkpoint that changes them, before DDP(model); or wrap the model again after the change.",
        locations={str(rank): ws[0]["site"] or "?" for rank, ws in sorted(replaced.items())},
        details={"replaced": targets, "kind": first["kind"]},
    )]


CHECK = Check(
    name=NAME,
    summary="one training state on every rank, and the write that split it",
    categories={
        "state_written_on_some_ranks": Category(
            ("error",),
            "the training state differs across ranks after a write some ranks made, or made with different values",
            "going into an optimizer step, the parameters, the optimizer's settings or per-parameter state, the "
            "GradScaler's or an LR scheduler's state differ across ranks, and a write before that step explains it: "
            "`load_state_dict` of a module, optimizer, GradScaler or scheduler made on some ranks only (a checkpoint "
            "restored on rank 0 after DDP was built), or a `scheduler.step` every rank made with a different result "
            "(ReduceLROnPlateau fed each rank's own validation loss). Says what differs first and when it parted; "
            "named at the write",
        ),
        "replaced_after_wrapping": Category(
            ("error",),
            "a parameter or submodule of a model was replaced after DDP wrapped it: its gradients are never averaged",
            "a parameter or submodule of a model wrapped in DDP was assigned anew after DDP was built (a new head, an "
            "adapter wrapped around a layer): DDP averages and broadcasts only the parameters it was given, so the new "
            "ones train apart on every rank. Named at the assignment. Replacements before wrapping, and buffers "
            "(DDP collects them anew before each sync), are left alone",
        ),
        "companion_apart": Category(
            ("warning",),
            "a module run beside the trained model (an EMA teacher, a target network, a normalizer) differs across ranks",
            "going into an optimizer step, the parameters or buffers of a module the training step calls outside every "
            "wrapped model, and no optimizer steps (gradsync.run.companions), differ across ranks: DDP neither "
            "broadcasts nor averages it. Named at the write that parted it (an update only some ranks made, or one "
            "each rank made from its own batch; at the training loop's line it was made under), else where its "
            "parameters were made apart, else at its call",
        ),
    },
    rule=state_findings,
    explains={
        "state_written_on_some_ranks": ("update_differs", "parameters_diverged", "buffers_diverged"),
        "replaced_after_wrapping": ("update_differs", "parameters_diverged", "buffers_diverged", "gradients_not_averaged"),
    },
    watch=StateWatch,
    facts=StateFacts,
)
