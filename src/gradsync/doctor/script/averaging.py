"""Averaging really happens: every gradient the optimizer applies was averaged across ranks, once.

Data-parallel training is one model trained on the global batch only because each step applies
the gradient averaged over the ranks. Three sets must line up for that: the parameters the
optimizer steps, the parameters the wrapper (or the script's own all_reduce) averages, and the
parameters the forward used. Where they part, nothing fails: a forward through `ddp.module`
skips DDP's reducer, a head added after wrapping is outside DDP's buckets, hand-written
averaging covers one param_group, an optimizer built before `fully_shard` steps the old
parameters, an all_reduce after DDP's sums the average again.

So each rank records, going into each of the first STEPS_COMPARED counted steps, which stepped
parameters' gradients DDP reduced, which the script reduced itself (and where), a sampled
fingerprint of each gradient, the forwards of a DDP model's inner module that ran outside DDP,
and the wrapped parameters with a gradient that no optimizer holds. The rule compares the
gradients across ranks: an averaged gradient is the same on every rank, so a gradient that
differs was not averaged, and the sets say where they parted.

Cost: per step compared, a sampled fingerprint of each stepped gradient and a pass over the
parameters; per collective the script calls itself, a look at its first 64 values.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, TypedDict

import torch
from torch.nn.parallel import DistributedDataParallel

from gradsync import compat
from gradsync.rundir.records import Finding
from gradsync.run.activity import choosing_condition, enclosing_loop
from gradsync.callsite import caller_location, entry_site, location, short_path, user_frame
from gradsync.run.check_primitives import Patches, dtensor_class, tensor_fingerprint, tensors_fingerprint
from gradsync.run.harmless import BookkeepingByKind
from gradsync.doctor.script.compare import names_text, ranks_text
from gradsync.run.moments import Moments
from gradsync.doctor.script.shared_facts import own_facts
from gradsync.doctor.script.unit import Category, Check, RankFacts

NAME = "averaging"
STEPS_COMPARED = 8  # counted steps whose gradients are fingerprinted one by one
BYPASSES_KEPT = 4  # lines where a forward bypassed DDP, kept per rank
POINTERS_KEPT = 100_000  # reduced tensors remembered (a per-parameter loop over a large model)
_REDUCING = frozenset({"all_reduce", "reduce"})


class AveragingFacts(TypedDict):
    """What the watch records on one rank (under "averaging" in its facts file)."""

    steps: list[dict[str, Any]]  # per checked step: the gradients stepped, reduced and used, by parameter
    bypasses: list[dict[str, Any]]  # forwards through `ddp.module`, with their line
    sharded_at: str | None  # the last fully_shard call's line


class AveragingWatch:
    """Which gradients each step applies, and who averaged them, on one rank."""

    def __init__(self, moments: Moments, bookkeeping: BookkeepingByKind) -> None:
        self.moments = moments
        self.bookkeeping = bookkeeping[f"the {NAME} check's watch"]
        self.steps: list[dict[str, Any]] = []
        self.bypasses: list[dict[str, Any]] = []
        self._names: dict[int, str] = {}  # id of a DDP model's parameter -> its name in the model
        self._optimized: set[int] = set()  # ids of the parameters of every optimizer seen stepping
        # id of a tensor all-reduced since the last step -> the tensor (weakly: an id is reused once
        # it dies), its line, the loop around that line, and its magnitude before (to tell a
        # reduction that changed the values from one that did not)
        self._reduced: dict[int, tuple[weakref.ref, str | None, str | None, float]] = {}
        self._loop_sites: dict[str | None, str | None] = {}  # a collective's line -> the loop around it
        # (data_ptr, numel) of every tensor the script all-reduced: parameters among them are
        # averaged themselves (local SGD, through `p.data`), so their gradients need not be. A
        # broadcast is not averaging (the usual start: rank 0's weights sent to all).
        self._all_reduced: set[tuple[int, int]] = set()
        self._reductions_before = 0  # DDP's synchronised passes at the previous step
        self._built_at: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> the line that built it
        self._dtensor = dtensor_class()
        # Accumulation: whether each DDP model's latest backward pass synchronised (DDP averages only
        # those; a step after passes run under no_sync() applies each rank's own sum).
        self._owner: dict[int, int] = {}  # id of a DDP model's parameter -> id of the model
        self._forwarded: dict[int, bool] = {}  # id of a DDP model that ran a training forward since its backward -> it syncs
        self._last_synced: dict[int, bool] = {}  # id of a DDP model -> whether its latest backward synchronised
        self._no_sync_site: str | None = None  # the line that entered no_sync() last
        self._no_sync_conditions: dict[str | None, str | None] = {}  # that line -> the condition that chose it
        self._unsynced: list[str | None] = []  # lines of the backward passes since the last step that did not sync
        moments.on("wrapped", self._wrapped, self.bookkeeping)
        moments.on("forward_starts", self._forward_starts, self.bookkeeping)
        moments.on("backward", self._backward, self.bookkeeping)
        moments.on("collective", self._collective, self.bookkeeping)
        moments.on("step_starts", self._step_starts, self.bookkeeping)
        moments.on("step_ends", self._step_ends, self.bookkeeping)

    def install(self, patches: Patches) -> None:
        """Note where each optimizer is built (the line its parameters were chosen at)."""
        from torch.optim import Optimizer

        watch = self

        def make(original):
            def __init__(optimizer, *args, **kwargs):
                original(optimizer, *args, **kwargs)
                with watch.bookkeeping:
                    watch._built_at.setdefault(optimizer, caller_location())

            return __init__

        patches.wrap(Optimizer, "__init__", make)

        def make_no_sync(original):
            def no_sync(ddp, *args, **kwargs):
                with watch.bookkeeping:
                    watch._no_sync_site = site = caller_location()
                    if site not in watch._no_sync_conditions and len(watch._no_sync_conditions) < BYPASSES_KEPT:
                        watch._no_sync_conditions[site] = choosing_condition(sys._getframe(1))
                return original(ddp, *args, **kwargs)

            return no_sync

        patches.wrap(DistributedDataParallel, "no_sync", make_no_sync)

    # -- the moments -------------------------------------------------------------------------

    def _wrapped(self, ddp: Any, site: str | None) -> None:
        for name, parameter in ddp.module.named_parameters():
            self._names.setdefault(id(parameter), name)
            self._owner.setdefault(id(parameter), id(ddp))
        self.moments.module_forwards.watch(ddp.module, self._inner_forward)

    def _forward_starts(self, ddp: Any, forward: dict[str, Any]) -> None:
        self._forwarded[id(ddp)] = bool(compat.DDP_SYNCS_GRADIENTS.get(True, ddp))

    def _backward(self, tensors: Any) -> None:
        forwarded, self._forwarded = self._forwarded, {}
        for model, syncs in forwarded.items():
            self._last_synced[model] = syncs
            if not syncs and len(self._unsynced) < 8:
                self._unsynced.append(self._no_sync_site or caller_location())

    def _inner_forward(self, module: Any, args: Any) -> None:
        # A forward pre-hook in the user's forward: returning None leaves its inputs alone.
        with self.bookkeeping:
            if (self.moments.forwarding or not module.training or not torch.is_grad_enabled()
                    or len(self.bypasses) >= BYPASSES_KEPT):
                return
            site = entry_site(module)
            if all(b["site"] != site for b in self.bypasses):
                self.bypasses.append({"site": site, "step": self.moments.steps + 1})

    def _collective(self, op: str, args: tuple, kwargs: dict, site: str | None) -> None:
        if op not in _REDUCING:
            return
        tensors = [args[0] if args else kwargs.get("tensor")]
        if site not in self._loop_sites:
            self._loop_sites[site] = _loop_around(user_frame(sys._getframe(1)))
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor) or tensor.is_meta:
                continue
            if len(self._reduced) < POINTERS_KEPT and self._reduced_before(tensor) is None:
                self._reduced[id(tensor)] = (weakref.ref(tensor), site, self._loop_sites[site], _magnitude(tensor))
            if len(self._all_reduced) < POINTERS_KEPT:
                self._all_reduced.add((tensor.data_ptr(), tensor.numel()))

    def _reduced_before(self, tensor: torch.Tensor) -> tuple[str | None, str | None, float] | None:
        """(line, loop, magnitude before) of this very tensor's reduction since the last step."""
        entry = self._reduced.get(id(tensor))
        return entry[1:] if entry is not None and entry[0]() is tensor else None

    def _step_starts(self, optimizer: Any, step: int) -> None:
        groups = [group["params"] for group in optimizer.param_groups]
        self._optimized.update(id(p) for params in groups for p in params)
        if len(self.steps) >= STEPS_COMPARED:
            return
        ddp_reduced = self.moments.reductions > self._reductions_before
        names, grads, by_hand, unreduced, twice, scaled, created = [], [], {}, [], [], None, {}
        in_ddp = []
        for g, params in enumerate(groups):
            for i, p in enumerate(params):
                if p.grad is None or self._sharded(p):
                    continue
                name = self._names.get(id(p)) or f"param_groups[{g}][{i}] ({str(p.dtype).removeprefix('torch.')}{list(p.shape)})"
                names.append(name)
                grads.append(tensor_fingerprint(p.grad))
                # Averaged by DDP when its model's latest backward synchronised (passes under
                # no_sync() after it add each rank's own gradient to the average).
                averaged_by_ddp = id(p) in self._names and ddp_reduced and self._last_synced.get(self._owner.get(id(p)), True)
                if id(p) in self._names:
                    in_ddp.append(name)
                reduced = self._reduced_before(p.grad)
                if reduced is not None:
                    by_hand[name] = reduced[:2]
                    if averaged_by_ddp and reduced[2] > 0:
                        # Reduced again after DDP's average: a mistake where it changed the values (a
                        # sum, a reduce to one rank), not where it averaged the average again.
                        change = _magnitude(p.grad) / reduced[2]
                        if abs(change - 1) > 1e-3:
                            twice.append(name)
                            scaled = scaled or round(change, 3)
                if not (averaged_by_ddp or reduced is not None or (p.data_ptr(), p.numel()) in self._all_reduced):
                    unreduced.append(name)
                    created[name] = self.moments.created_at(p)
        self.steps.append({
            "step": step,
            "site": location(user_frame(sys._getframe(1))),
            "names": names,
            "grads": grads,
            "ddp_reduced": ddp_reduced,
            "in_ddp": in_ddp,
            "by_hand": by_hand,
            "unreduced": unreduced,
            "unsynced_at": list(dict.fromkeys(self._unsynced)),  # passes since the last step under no_sync()
            # the condition that chose each of those no_sync() lines (None: none holds it)
            "unsynced_chosen_at": [self._no_sync_conditions.get(site) for site in dict.fromkeys(self._unsynced)],
            "created": created,  # where each unreduced parameter was made
            "twice": twice,
            "scaled_by": scaled,
            "not_stepped": self._not_stepped(),
            "optimizer_built_at": self._built_at.get(optimizer),
            # Where the replicas start from (the first step only): without a wrapper, nothing but
            # the script evens out parameters that were made apart.
            "initial": self._initial(optimizer) if not self.steps else None,
        })

    def _initial(self, optimizer: Any) -> dict[str, Any]:
        parameters = [p for group in optimizer.param_groups for p in group["params"] if not self._sharded(p)]
        return {"parameters": tensors_fingerprint(parameters),
                "created_at": next((site for site in map(self.moments.created_at, parameters) if site), None)}

    def _step_ends(self, optimizer: Any, step: int) -> None:
        self._reductions_before = self.moments.reductions
        self._unsynced.clear()
        self._reduced.clear()

    def _sharded(self, parameter: Any) -> bool:
        """A DTensor parameter: FSDP or tensor parallelism reduces its gradient by its own plan."""
        return self._dtensor is not None and isinstance(parameter, self._dtensor)

    def _not_stepped(self) -> list[str]:
        """The wrapped parameters (of DDP models and fully_shard units) holding a gradient that no
        optimizer seen so far steps."""
        missing = []
        # The outermost fully_shard unit is sharded last: named from it, a parameter has its full name.
        models = [ddp.module for ddp in self.moments.models] + [unit for unit, _ in reversed(self.moments.sharded)]
        seen: set[int] = set()
        for module in models:
            for name, p in module.named_parameters():
                if id(p) in seen:
                    continue
                seen.add(id(p))
                if p.grad is not None and id(p) not in self._optimized:
                    missing.append(name)
        return missing[:64]

    def facts(self) -> AveragingFacts:
        sharded = [site for _, site in self.moments.sharded]
        return {"steps": self.steps, "bypasses": self.bypasses, "sharded_at": sharded[-1] if sharded else None}


def _magnitude(tensor: torch.Tensor) -> float:
    """The sum of the absolute values of a tensor's first elements: how a reduction scaled it."""
    return float(tensor.detach().reshape(-1)[:64].double().abs().sum())


def _loop_around(frame: Any) -> str | None:
    """file:line of the loop around a frame's current line (a loop over parameters that all-reduces
    each gradient is where the set of averaged parameters is chosen)."""
    if frame is None:
        return None
    code = frame.f_code
    loop = enclosing_loop(code.co_filename, code.co_firstlineno, {frame.f_lineno})
    return f"{short_path(code.co_filename)}:{loop}" if loop is not None else None


# -- the rule -----------------------------------------------------------------------------------


def averaging_findings(checks: RankFacts) -> list[Finding]:
    recorded = own_facts(checks, NAME)
    if recorded is None:
        return []
    return [*(_started_apart(recorded) or _not_averaged(recorded)), *_averaged_twice(recorded), *_not_stepped(recorded)]


def _started_apart(recorded: dict[int, Any]) -> list[Finding]:
    """A script that averages gradients itself, without a wrapper, must also start every replica
    from the same parameters (DDP broadcasts rank 0's when it is built): averaged gradients applied
    to parameters made apart (a seed per rank before the model) keep them apart for good."""
    aligned = _aligned(recorded)
    if not aligned:
        return []
    first = aligned[0]
    initial = {rank: r.get("initial") or {} for rank, r in first.items()}
    if any(r["in_ddp"] for r in first.values()) or not any(r["by_hand"] for r in first.values()):
        return []
    fingerprints = {rank: i.get("parameters") for rank, i in initial.items()}
    if None in fingerprints.values() or len(set(fingerprints.values())) == 1:
        return []
    ranks = sorted(first)
    made = {rank: initial[rank].get("created_at") for rank in ranks}
    where = made[ranks[0]]
    return [Finding(
        "replicas_started_apart",
        "error",
        ranks,
        f"Going into the first optimizer step, the parameters the script averages gradients for by hand differ "
        f"across ranks{f' (created at {where})' if where else ''}: no wrapper broadcast rank 0's, and the script did "
        "not either. Every rank then applies the same averaged gradient to its own starting point, and the replicas "
        "never meet; a checkpoint saved by rank 0 holds only its own.",
        "Start every rank from the same parameters: seed the model's construction alike on every rank, or broadcast "
        "rank 0's after building it (`for t in model.state_dict().values(): dist.broadcast(t, src=0)`), or wrap the "
        "model in DistributedDataParallel, which does both the broadcast and the averaging.",
        locations={str(rank): made[rank] or first[rank]["site"] or "?" for rank in ranks},
        step=1,
    )]


def _aligned(recorded: dict[int, Any]) -> list[dict[int, dict[str, Any]]]:
    """Per step compared: rank -> its record, where every rank recorded the same parameters."""
    count = min(len(facts["steps"]) for facts in recorded.values())
    aligned = []
    for index in range(count):
        by_rank = {rank: facts["steps"][index] for rank, facts in recorded.items()}
        if len({(r["step"], tuple(r["names"])) for r in by_rank.values()}) == 1:
            aligned.append(by_rank)
    return aligned


def _not_averaged(recorded: dict[int, Any]) -> list[Finding]:
    for by_rank in _aligned(recorded):
        first = next(iter(by_rank.values()))
        names = first["names"]
        differing = [name for i, name in enumerate(names)
                     if None not in {r["grads"][i] for r in by_rank.values()} and len({r["grads"][i] for r in by_rank.values()}) > 1]
        # Differing, and averaged by nobody on any rank: not a reduction that went wrong, one that never ran.
        missing = [name for name in differing if all(name in r["unreduced"] for r in by_rank.values())]
        if not missing:
            continue
        ranks = sorted(by_rank)
        step = first["step"]
        bypasses = {rank: [b for b in recorded[rank]["bypasses"] if b["step"] <= step] for rank in ranks}
        hand = sorted({(site, loop) for r in by_rank.values() for site, loop in r["by_hand"].values() if site},
                      key=lambda pair: (pair[1] or "", pair[0]))
        locations = {str(rank): by_rank[rank]["site"] or "?" for rank in ranks}
        if all(bypasses.values()):
            why = (f"the forward at {bypasses[ranks[0]][0]['site'] or '?'} ran the model inside DDP (its `.module`) "
                   "instead of DDP itself, so DDP's reducer was never prepared and averaged nothing")
            locations = {str(rank): bypasses[rank][0]["site"] or "?" for rank in ranks}
            fix = ("Call the DDP model itself for every training forward (`ddp(batch)`); to reach a method such as "
                   "`compute_loss`, make it part of `forward` (or pass a flag to forward): DDP averages only "
                   "gradients of forwards that went through it.")
        elif hand:
            site, loop = hand[0]
            why = (f"the script averages gradients itself (the all_reduce at {site}"
                   f"{f', in the loop at {loop}' if loop else ''}), and that covered {len(first['by_hand'])} of the "
                   f"{len(names)} parameters with a gradient; the others were left out")
            locations = {str(rank): loop or site for rank in ranks}
            fix = ("Average every gradient the optimizer steps: loop over all param_groups (or model.parameters()), "
                   "or wrap the model in DistributedDataParallel, which averages every parameter it was given.")
        elif set(missing) <= set(first["in_ddp"]) and any(r.get("unsynced_at") for r in by_rank.values()):
            site = next(r["unsynced_at"][-1] for r in by_rank.values() if r.get("unsynced_at"))
            # Named at the condition that chose no_sync() for the micro-batch the step ended, where it is known.
            chosen = {rank: (r.get("unsynced_chosen_at") or [None])[-1] or (r.get("unsynced_at") or [site])[-1] or "?"
                      for rank, r in by_rank.items()}
            condition = chosen[ranks[0]]
            why = (f"DDP did not average them before this step: its latest backward pass ran under no_sync() (entered at "
                   f"{site}{f', chosen by the condition at {condition}' if condition != site else ''}), so the step "
                   "applied each rank's own accumulated gradient; the condition that chose no_sync() and the one that "
                   "chose the step disagreed on this micro-batch")
            locations = {str(rank): chosen[rank] for rank in ranks}
            fix = ("Step only after a backward pass outside no_sync(): derive both from one condition, e.g. `sync = "
                   "(i + 1) % accumulation == 0 or i + 1 == len(loader)`; `with ddp.no_sync() if not sync else "
                   "nullcontext(): loss.backward()`; `if sync: optimizer.step()`.")
        elif first["in_ddp"]:
            why = ("they are not among the parameters DDP was given at construction (added or replaced after "
                   "wrapping, or belonging to another model)")
            fix = ("Wrap the whole model after it is fully built, and give the optimizer ddp.parameters(); a module "
                   "trained beside it needs its own DDP wrapper; a parameter of its own (a learnable temperature, a "
                   "loss weight) belongs inside the wrapped model, as an attribute of one of its modules.")
        else:
            why = "no rank averaged them: the model is not wrapped in DDP (or FSDP), and the script all-reduced none of them"
            fix = ("Wrap the model in DistributedDataParallel (or FSDP), or all_reduce every gradient and divide by "
                   "the world size before optimizer.step().")
        made = {rank: (by_rank[rank].get("created") or {}).get(missing[0]) for rank in ranks}
        if first["in_ddp"] and not all(bypasses.values()) and not hand and missing[0] not in first["in_ddp"] and all(made.values()):
            # The parameter came from somewhere DDP never saw: the line that made it is the cause.
            why += f"; {missing[0]} was created at {made[ranks[0]]}"
            locations = {str(rank): made[rank] for rank in ranks}
        return [Finding(
            "gradients_not_averaged",
            "error",
            ranks,
            f"Going into optimizer step {step} (at {first['site'] or '?'}), the gradients of {len(missing)} of the "
            f"{len(names)} parameters it applies differ across ranks ({names_text(missing)}): {why}. Each rank "
            f"steps with its own gradient, so the replicas drift apart and the job trains like {len(ranks)} separate "
            "runs, without an error.",
            fix,
            locations=locations,
            step=step,
            details={"parameters": missing[:20], "of": len(names)},
        )]
    return []


def _averaged_twice(recorded: dict[int, Any]) -> list[Finding]:
    for by_rank in _aligned(recorded):
        twice = {rank: r for rank, r in by_rank.items() if r["twice"]}
        if not twice:
            continue
        ranks = sorted(twice)
        first = twice[ranks[0]]
        sites = {rank: r["by_hand"][r["twice"][0]][0] for rank, r in twice.items()}
        parted = len({tuple(r["grads"]) for r in by_rank.values()}) > 1  # a reduce to one rank: the others' differ
        return [Finding(
            "gradients_averaged_twice",
            "error",
            ranks,
            f"Going into optimizer step {first['step']}, DDP had averaged the gradients of {len(first['twice'])} "
            f"parameters ({names_text(first['twice'])}), and the script reduced them again at {sites[ranks[0]] or '?'}, "
            f"which scaled them by {first['scaled_by']:g} on {ranks_text(ranks)}"
            + (": the ranks now step with different gradients, and the replicas part" if parted else
               ": every update is that far off the averaged one, and the error grows with the number of ranks") + ".",
            "Leave the averaging to DDP and remove the hand-written reduction of gradients; to average by hand "
            "instead, skip DDP's own with `with ddp.no_sync():` around the backward.",
            locations={str(rank): sites[rank] or "?" for rank in ranks},
            step=first["step"],
            details={"parameters": first["twice"][:20], "scaled_by": first["scaled_by"]},
        )]
    return []


def _not_stepped(recorded: dict[int, Any]) -> list[Finding]:
    """Wrapped parameters with gradients that no optimizer held at any step after the first (at the
    first, the optimizer of a second model may just not have stepped yet)."""
    later = {rank: facts["steps"][1:] for rank, facts in recorded.items()}
    if not all(later.values()):
        return []
    always = {rank: set.intersection(*(set(r["not_stepped"]) for r in records)) for rank, records in later.items()}
    missing = sorted(set.intersection(*always.values()))
    if not missing:
        return []
    ranks = sorted(recorded)
    first = recorded[ranks[0]]["steps"][1]
    sharded_at = recorded[ranks[0]]["sharded_at"]
    empty = all(not r["names"] for records in later.values() for r in records)
    built_at = first.get("optimizer_built_at") or first["site"] or "?"
    why = (f"`fully_shard` (last at {sharded_at}) replaced the module's parameters with sharded ones after the "
           f"optimizer was built (at {built_at}), so the optimizer holds the parameters from before, which no forward uses"
           if sharded_at else f"The optimizer built at {built_at} does not hold them: they were made after it (a layer "
           "replaced or added), or belong to another module")
    return [Finding(
        "parameters_not_stepped",
        "error" if empty else "warning",
        ranks,
        f"From optimizer step {first['step']} (at {first['site'] or '?'}) on, {len(missing)} parameters of the "
        f"wrapped model got gradients that no optimizer applies ({names_text(missing)})"
        + (": the optimizer steps none of the parameters the forward used" if empty else "")
        + f". {why}. They never train, and nothing fails.",
        "Build the optimizer from the model's parameters after the model is final: after fully_shard (FSDP2 "
        "replaces every parameter with a sharded one) and after replacing any layer.",
        locations={str(rank): sharded_at or built_at for rank in ranks},
        step=first["step"],
        details={"parameters": missing[:20]},
    )]


CHECK = Check(
    name=NAME,
    summary="every gradient the optimizer applies was averaged across ranks, once",
    categories={
        "gradients_not_averaged": Category(
            ("error",),
            "the optimizer applied gradients that differ across ranks: nothing averaged them",
            "going into one of the first steps, gradients the optimizer applies differ across ranks and neither DDP "
            "nor the script reduced them: a forward through `ddp.module` (named at the call), hand-written "
            "averaging that left parameters out (named at its loop), parameters outside DDP's, or no wrapper "
            "at all. Parameters sharded as DTensors (FSDP2, tensor parallelism) and parameters averaged "
            "themselves (an all_reduce of the parameters: local SGD) are left alone",
        ),
        "replicas_started_apart": Category(
            ("error",),
            "a script that averages gradients by hand started its replicas from different parameters",
            "the script averages gradients itself (no DDP or FSDP) and the parameters differ across ranks going into "
            "the first step: nothing broadcast rank 0's (DDP does at construction), so averaging identical gradients "
            "never brings the replicas together. Named where the parameters were created",
        ),
        "gradients_averaged_twice": Category(
            ("error",),
            "DDP averaged the gradients and the script reduced them again, changing them",
            "the script all-reduced (or reduced to one rank) a gradient that DDP had already averaged in the same "
            "step, and that changed it: a sum of the averages makes every update world-size times the intended one. "
            "Named at the reduction. Averaging the average again (a sum divided by the world size) is left alone",
        ),
        "parameters_not_stepped": Category(
            ("error", "warning"),
            "parameters of the wrapped model got gradients that no optimizer applies",
            "from the second step on, parameters of a DDP model or `fully_shard` unit hold gradients and no optimizer "
            "steps them: an optimizer built before `fully_shard` replaced the parameters (an error when it steps "
            "nothing the forward used; named at `fully_shard`), or before a layer was replaced",
        ),
    },
    rule=averaging_findings,
    explains={"gradients_not_averaged": ("parameters_diverged", "buffers_diverged", "update_differs"),
              "replicas_started_apart": ("parameters_diverged", "buffers_diverged", "update_differs",
                                         "state_written_on_some_ranks"),
              "gradients_averaged_twice": ("parameters_diverged", "buffers_diverged", "update_differs")},
    watch=AveragingWatch,
    facts=AveragingFacts,
)
