"""collective_arguments: what the script hands torch.distributed is sane: outputs that do not share memory, one dtype everywhere.

A collective writes where it is told. An `all_gather` output list built as `[t] * world_size` holds
one tensor several times: every rank's data lands in it, the last write wins, and the "gathered"
list holds copies of one rank's values; an input that overlaps another rank's output slot is
overwritten while it is sent. A tensor of another dtype on one rank (int32 against float32: the
same byte count) is not refused by Gloo: the bytes are read as the other type. Nothing fails.

And a result must be used: `torch.distributed.nn.all_reduce(x)` returns the sum and leaves `x` as
it was, and `dist.all_reduce(x.float())` reduces a copy; the script goes on with its own rank's
values. So the tensor a collective wrote into (or returned) is watched until its first read
(gradsync.run.tensor_writes.ResultReads: any torch function, collective or Python use of it); one
dropped before that was never read.

And a gathered copy carries no gradient: `dist.all_gather(gathered, features)` fills every slot,
this rank's own included, with copies that autograd does not connect to `features`. A loss
computed from `torch.cat(gathered)` (a contrastive loss's candidates, the statistics of a global
batch) then gives this rank's features no gradient through their own slot. So the own slot of an
all_gather of a tensor that requires grad is followed through every torch call computed from it
(gradsync.run.tensor_writes.Derivations), and a loss it reaches at backward is said; a script that
puts its own tensor back in the slot (the usual fix) drops the copy, which then reaches nothing.

So each rank records, for each of the first collectives the script calls itself on tensors, the
dtypes it passed and whether its outputs share memory with each other, or its input with an
output other than its own slot, and the results dropped unread. The rule names a call whose
outputs alias, and the first call (by line and occurrence) whose dtypes differ across ranks, and
a call whose result nothing read.

Cost: per collective the script calls, a look at its tensors' addresses and dtypes; while a
result awaits its first read, a look at the arguments of each torch call.
"""

from __future__ import annotations

import sys
from typing import Any, TypedDict

import torch

from gradsync.callsite import caller_location, is_user_file, short_path, user_frame
from gradsync.doctor.script.compare import ranks_text
from gradsync.doctor.script.shared_facts import own_facts
from gradsync.doctor.script.unit import Category, Check, RankFacts
from gradsync.run.activity import assigned_at
from gradsync.run.check_primitives import Patches
from gradsync.run.harmless import BookkeepingByKind
from gradsync.run.moments import Moments
from gradsync.rundir.records import Finding

NAME = "collective_arguments"
MAX_CALLS = 128  # collectives recorded per rank

# op -> (where its output (or output list) is: position, keyword), (where its input is), whether the
# input may be this rank's own slot of the output (torch's in-place forms)
_OUTPUTS = {
    "all_gather": ((0, "tensor_list"), (1, "tensor"), True),
    "all_gather_into_tensor": ((0, "output_tensor"), (1, "input_tensor"), True),
    "all_to_all": ((0, "output_tensor_list"), (1, "input_tensor_list"), False),
    "all_to_all_single": ((0, "output"), (1, "input"), False),
    "gather": ((1, "gather_list"), (0, "tensor"), True),
    "reduce_scatter": ((0, "output"), (1, "input_list"), False),
    "reduce_scatter_tensor": ((0, "output"), (1, "input"), True),
}


# op -> where the result lands (position, keyword), and the rank that receives it when only one does
# (the keyword naming it; None: every rank). In-place ops write the tensor they are given.
_RESULTS = {
    "all_reduce": ((0, "tensor"), None),
    "broadcast": ((0, "tensor"), "src"),  # every rank but src receives
    "reduce": ((0, "tensor"), "dst"),
    "all_gather": ((0, "tensor_list"), None),
    "all_gather_into_tensor": ((0, "output_tensor"), None),
    "reduce_scatter": ((0, "output"), None),
    "reduce_scatter_tensor": ((0, "output"), None),
    "all_to_all": ((0, "output_tensor_list"), None),
    "all_to_all_single": ((0, "output"), None),
    "gather": ((1, "gather_list"), "dst"),
    "scatter": ((0, "tensor"), None),
}
TOKEN_ELEMENTS = 8  # a tensor this small holding only 0, 1 or the world size is a token (a barrier made of an all_reduce)


class ArgumentFacts(TypedDict):
    """What the watch records on one rank (under "collective_arguments" in its facts file)."""

    # per call: {"op", "site", "dtypes": [input's, outputs'...], "aliased": [i, j] or None: two output
    #  positions that share memory, "overlaps": an output position the input shares memory with, or None}
    calls: list[dict[str, Any]]
    # results nothing read before they were dropped: {"op", "site", "times"}, by op and line
    unread: list[dict[str, Any]]
    # losses computed from this rank's own slot of an all_gather of a tensor that requires grad:
    # {"site": the all_gather's line, "loss_site": the backward's, "step": optimizer steps before it}
    gathered_into_loss: list[dict[str, Any]]


def _argument(args: tuple, kwargs: dict, where: tuple[int, str]) -> Any:
    position, keyword = where
    return args[position] if len(args) > position else kwargs.get(keyword)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for t in value if isinstance(t, torch.Tensor)]
    return []


def _span(tensor: torch.Tensor) -> tuple[int, int] | None:
    try:
        start = tensor.data_ptr()
    except RuntimeError:
        return None
    end = start + tensor.numel() * tensor.element_size()
    return (start, end) if start and end > start else None


def _shared(a: tuple[int, int] | None, b: tuple[int, int] | None) -> bool:
    return a is not None and b is not None and a[0] < b[1] and b[0] < a[1]


class ArgumentWatch:
    """The tensors of each collective the script calls on one rank: their dtypes and shared memory."""

    def __init__(self, moments: Moments, bookkeeping: BookkeepingByKind) -> None:
        self.moments = moments
        self.bookkeeping = bookkeeping[f"the {NAME} check's watch"]
        self.calls: list[dict[str, Any]] = []
        self.unread: list[dict[str, Any]] = []
        self.gathered_into_loss: list[dict[str, Any]] = []
        self._awaited = 0  # results watched so far
        moments.on("collective", self._collective, self.bookkeeping)
        moments.on("collective_returned", self._returned, self.bookkeeping)
        moments.on("collective_returned", self._gathered, self.bookkeeping)
        moments.on("backward", self._backward, self.bookkeeping)

    def install(self, patches: Patches) -> None:
        """Nothing beyond the host's moments."""

    def _collective(self, op: str, args: tuple, kwargs: dict, site: str | None) -> None:
        if len(self.calls) >= MAX_CALLS:
            return
        record: dict[str, Any] = {"op": op, "site": site, "aliased": None, "overlaps": None}
        if op in _OUTPUTS:
            output_at, input_at, own_slot = _OUTPUTS[op]
            outputs, inputs = _tensors(_argument(args, kwargs, output_at)), _tensors(_argument(args, kwargs, input_at))
            spans = [_span(t) for t in outputs]
            record["aliased"] = next(([i, j] for i in range(len(spans)) for j in range(i + 1, len(spans))
                                      if _shared(spans[i], spans[j])), None)
            if record["aliased"]:
                record["built_at"] = _built_at(sys._getframe(1), _argument(args, kwargs, output_at))
            if len(inputs) == 1 and len(outputs) > 1:
                own = _own_slot(_group(args, kwargs), len(outputs)) if own_slot else None
                record["overlaps"] = next((i for i, span in enumerate(spans) if i != own and _shared(_span(inputs[0]), span)),
                                          None)
            elif len(inputs) == 1 and len(outputs) == 1 and not own_slot and _shared(_span(inputs[0]), spans[0]):
                record["overlaps"] = 0
            tensors = inputs + outputs
        else:
            tensors = _tensors(args[0] if args else kwargs.get("tensor"))
        record["dtypes"] = [str(t.dtype).removeprefix("torch.") for t in tensors]
        self.calls.append(record)

    def _returned(self, op: str, args: tuple, kwargs: dict, site: str | None, returned: Any) -> None:
        """Await the first read of what the call wrote: a result nothing reads was computed for nothing
        (an out-of-place collective's return value dropped, a temporary `x.float()` reduced in place)."""
        import torch.distributed as dist

        writes = self.moments.tensor_writes
        if writes is None or op not in _RESULTS or self._awaited >= MAX_CALLS:
            return
        where, receiver = _RESULTS[op]
        if receiver is not None and returned is None:  # a differentiable one returns what every rank uses
            position = 2 if op == "gather" else 1
            root = kwargs.get(receiver, args[position] if len(args) > position else 0)
            if (dist.get_rank() == root) == (op == "broadcast"):  # broadcast: src sends its own; reduce, gather: dst alone receives
                return
        world = dist.get_world_size() if dist.is_initialized() else 1
        async_op = bool(kwargs.get("async_op"))
        held = returned if returned is not None else _argument(args, kwargs, where)
        result = _tensors(held)
        if not result or (not async_op and all(_is_token(tensor, world) for tensor in result)):
            return
        if _named(held, result, sys._getframe(1)):
            return  # the script holds it by a name, and may read it later (a loss logged every k steps)
        if writes.await_read(result, lambda: self._unread(op, site)):
            self._awaited += 1

    def _gathered(self, op: str, args: tuple, kwargs: dict, site: str | None, returned: Any) -> None:
        """Follow this rank's own slot of an all_gather of a tensor that requires grad, in a forward
        that records gradients: dist.all_gather is not differentiable, so that slot is a copy no
        gradient flows back through (a script that puts its own tensor back in the slot drops it)."""
        writes = self.moments.tensor_writes
        if writes is None or op != "all_gather" or returned is not None or not torch.is_grad_enabled():
            return
        inputs = _tensors(_argument(args, kwargs, _OUTPUTS[op][1]))
        outputs = _tensors(_argument(args, kwargs, _OUTPUTS[op][0]))
        if len(inputs) != 1 or not inputs[0].requires_grad or len(outputs) < 2:
            return
        own = _own_slot(_group(args, kwargs), len(outputs))
        if own is not None and outputs[own] is not inputs[0] and not outputs[own].requires_grad:
            writes.follow(outputs[own], site)

    def _backward(self, tensors: Any) -> None:
        writes = self.moments.tensor_writes
        if writes is None or len(self.gathered_into_loss) >= MAX_CALLS:
            return
        for tensor in _tensors(tensors):
            site = writes.origin(tensor)
            if site is not None and all(entry["site"] != site for entry in self.gathered_into_loss):
                self.gathered_into_loss.append({"site": site, "loss_site": caller_location(), "step": self.moments.steps})

    def _unread(self, op: str, site: str | None) -> None:
        with self.bookkeeping:  # called as the tensor dies, wherever the script is then
            for entry in self.unread:
                if (entry["op"], entry["site"]) == (op, site):
                    entry["times"] += 1
                    return
            if len(self.unread) < MAX_CALLS:
                self.unread.append({"op": op, "site": site, "times": 1})

    def facts(self) -> ArgumentFacts:
        return {"calls": self.calls, "unread": self.unread, "gathered_into_loss": self.gathered_into_loss}


def _named(held: Any, result: list[torch.Tensor], frame: Any) -> bool:
    """Whether a frame of the user's code holds the result by a name: a local (or an item of a list,
    tuple or dict in one), or an attribute of an object in one (`self.stats`). A result with no
    name (`x.float()`, the return value of torch.distributed.nn.all_reduce) can only be read where
    the call stands; one with a name may be read later, or only on the steps that log it."""
    targets = {id(held), *map(id, result)}
    while frame is not None:
        if is_user_file(frame.f_code.co_filename):
            for value in frame.f_locals.values():
                if id(value) in targets:
                    return True
                if isinstance(value, (list, tuple)) and any(id(item) in targets for item in value):
                    return True
                if isinstance(value, dict) and any(id(item) in targets for item in value.values()):
                    return True
                attributes = getattr(value, "__dict__", None)
                if isinstance(attributes, dict) and any(id(item) in targets for item in attributes.values()):
                    return True
        frame = frame.f_back
    return False


def _is_token(tensor: torch.Tensor, world: int) -> bool:
    """A few zeros and ones (or the world size, their sum): a barrier's token, whose result nobody needs."""
    if tensor.numel() > TOKEN_ELEMENTS or tensor.is_meta:
        return False
    try:
        return set(tensor.detach().reshape(-1).tolist()) <= {0, 1, world}
    except (RuntimeError, TypeError):
        return False


def _built_at(frame: Any, value: Any) -> str | None:
    """The user's line that built `value` (an output list): the latest assignment, before the
    call, of the local name that holds it in the calling frame of the user's code."""
    frame = user_frame(frame)
    if frame is None:
        return None
    name = next((name for name, local in frame.f_locals.items() if local is value), None)
    if name is None:
        return None
    code = frame.f_code
    line = assigned_at(code.co_filename, code.co_firstlineno, name, frame.f_lineno)
    return f"{short_path(code.co_filename)}:{line}" if line is not None else None


def _group(args: tuple, kwargs: dict) -> Any:
    """The process group a collective was given (None: the default one)."""
    import torch.distributed as dist

    return kwargs.get("group") or next((a for a in args if isinstance(a, dist.ProcessGroup)), None)


def _own_slot(group: Any, slots: int) -> int | None:
    """This rank's position among a list of one slot per rank of `group`."""
    import torch.distributed as dist

    rank = dist.get_rank(group) if dist.is_initialized() else 0
    return rank if 0 <= rank < slots else None


def collective_arguments(checks: RankFacts) -> list[Finding]:
    recorded = own_facts(checks, NAME)
    if recorded is None:
        return []
    return [*(_aliased(recorded) or _dtypes_differ(recorded)), *_results_unread(recorded), *_gathered_into_loss(recorded)]


def _gathered_into_loss(recorded: dict[int, dict[str, Any]]) -> list[Finding]:
    found = {rank: facts["gathered_into_loss"][0] for rank, facts in recorded.items() if facts.get("gathered_into_loss")}
    if not found:
        return []
    ranks = sorted(found)
    first = found[ranks[0]]
    return [Finding(
        "gathered_copy_in_loss",
        "warning",
        ranks,
        f"On {ranks_text(ranks)}, the loss passed to backward at {first['loss_site'] or '?'} was computed from this "
        f"rank's own slot of the dist.all_gather at {first['site'] or '?'}, which gathered a tensor that requires grad. "
        "dist.all_gather is not differentiable: that slot is a copy no gradient flows back through, so the features "
        "reach the loss through the gathered batch as constants, and their gradient misses that part of the loss "
        "(a contrastive loss then trains each rank's features only as anchors, not as candidates).",
        "Put the rank's own tensor back in its slot after the gather (`gathered[rank] = features`, before "
        "`torch.cat(gathered)`), or gather with the differentiable torch.distributed.nn.functional.all_gather; "
        "detach the input first if the gathered batch is meant to carry no gradient.",
        locations={str(rank): found[rank]["site"] or "?" for rank in ranks},
        step=first["step"] + 1,
        details={"loss_site": first["loss_site"]},
    )]


def _results_unread(recorded: dict[int, dict[str, Any]]) -> list[Finding]:
    unread = {rank: facts.get("unread") or [] for rank, facts in recorded.items()}
    unread = {rank: entries[0] for rank, entries in unread.items() if entries}
    if not unread:
        return []
    ranks = sorted(unread)
    first = unread[ranks[0]]
    times = f" ({first['times']} times)" if first["times"] > 1 else ""
    return [Finding(
        "collective_result_unused",
        "warning",
        ranks,
        f"On {ranks_text(ranks)}, what dist.{first['op']} at {first['site'] or '?'} wrote was never read: the tensor "
        f"holding it was dropped before any use{times}. The script goes on with its own rank's values, as if the "
        "collective had not run: an out-of-place collective's return value thrown away "
        "(torch.distributed.nn.all_reduce(x) leaves x as it was), or an in-place one given a copy (`x.float()`, "
        "`x.clone()`, `torch.tensor(v)`) while the code reads the original.",
        "Use what the collective wrote: `x = torch.distributed.nn.all_reduce(x)`, or reduce the tensor you read "
        "afterwards in place (`x = x.float(); dist.all_reduce(x)`).",
        locations={str(rank): unread[rank]["site"] or "?" for rank in ranks},
        details={"op": first["op"], "times": {str(rank): entry["times"] for rank, entry in unread.items()}},
    )]


def _aliased(recorded: dict[int, dict[str, Any]]) -> list[Finding]:
    bad = {rank: next((c for c in facts["calls"] if c["aliased"] or c["overlaps"] is not None), None)
           for rank, facts in recorded.items()}
    bad = {rank: call for rank, call in bad.items() if call is not None}
    if not bad:
        return []
    ranks = sorted(bad)
    call = bad[ranks[0]]
    if call["aliased"]:
        i, j = call["aliased"]
        built = f", built at {call['built_at']}" if call.get("built_at") else ""
        what = (f"the outputs given to dist.{call['op']} at {call['site'] or '?'}{built} share memory (positions {i} "
                f"and {j}: one tensor listed twice, as `[t] * world_size` builds it): each rank's data lands in the same "
                "tensor, the last write wins, and every position holds one rank's values")
    else:
        what = (f"the input given to dist.{call['op']} at {call['site'] or '?'} shares memory with output position "
                f"{call['overlaps']}, another rank's slot: it is overwritten while it is sent")
    return [Finding(
        "collective_output_aliased",
        "error",
        ranks,
        f"On {ranks_text(ranks)}, {what}. Nothing fails; the gathered data is wrong on every rank that used it.",
        "Give every rank's result a tensor of its own: `[torch.empty_like(t) for _ in range(world_size)]` (not "
        "`[t] * world_size`), or one output tensor with dist.all_gather_into_tensor; keep the input out of the other "
        "ranks' slots.",
        # Where the list was built, when it was: that line made one tensor fill several places.
        locations={str(rank): bad[rank].get("built_at") or bad[rank]["site"] or "?" for rank in ranks},
        details={"op": call["op"], "aliased": call["aliased"], "overlaps": call["overlaps"], "called_at": call["site"]},
    )]


def _dtypes_differ(recorded: dict[int, dict[str, Any]]) -> list[Finding]:
    by_call: dict[tuple[str, str, int], dict[int, dict[str, Any]]] = {}
    for rank, facts in recorded.items():
        seen: dict[tuple[str, str], int] = {}
        for call in facts["calls"]:
            key = (call["op"], call["site"] or "?")
            seen[key] = seen.get(key, -1) + 1
            by_call.setdefault((*key, seen[key]), {})[rank] = call
    for (op, site, occurrence), calls in by_call.items():
        if len(calls) < len(recorded):
            continue
        dtypes = {rank: tuple(call["dtypes"]) for rank, call in calls.items()}
        if len(set(dtypes.values())) > 1:
            said = "; ".join(f"rank {rank} {', '.join(d) or '-'}" for rank, d in sorted(dtypes.items()))
            return [Finding(
                "collective_dtypes_differ",
                "error",
                sorted(calls),
                f"The ranks called dist.{op} at {site} (call {occurrence + 1} there) with tensors of different dtypes "
                f"({said}). The backend sends bytes: where the sizes agree (int32 and float32) nothing fails, and each "
                "rank reads the others' bytes as its own type.",
                "Pass tensors of one dtype on every rank (cast before the collective: `t.float()`), and build them the "
                "same way everywhere.",
                locations={str(rank): site for rank in sorted(calls)},
                details={"op": op, "dtypes": {str(rank): list(d) for rank, d in dtypes.items()}},
            )]
    return []


CHECK = Check(
    name=NAME,
    summary="the tensors handed to a collective: outputs that share memory, dtypes that differ by rank, results "
            "unread, a gathered copy of a rank's own features in its loss",
    categories={
        "collective_output_aliased": Category(
            ("error",),
            "a collective's outputs share memory (or its input overlaps another rank's output): the data is overwritten",
            "the output list of a collective the script called (`all_gather`, `all_to_all`, `gather`) holds one tensor "
            "twice (`[t] * world_size`) or tensors that share memory, or its input overlaps another rank's output slot: "
            "each rank's data overwrites the others'. Named at the call. An input that is this rank's own slot (torch's "
            "in-place form) is left alone",
        ),
        "collective_dtypes_differ": Category(
            ("error",),
            "the ranks called the same collective with tensors of different dtypes",
            "the ranks passed tensors of different dtypes to the same collective call (same line, same occurrence): "
            "Gloo sends bytes, and where the byte counts agree the values are read as the wrong type. Named at the call",
        ),
        "collective_result_unused": Category(
            ("warning",),
            "what a collective wrote was dropped before anything read it",
            "the tensor a collective the script called wrote its result into (or returned: the functional "
            "torch.distributed.nn collectives) died before any torch function, collective or Python use read it: the "
            "script goes on with its own values. Named at the call. Results the script holds by a name (a local, an "
            "item of one, an attribute: maybe read later), a few zeros and ones (a barrier's token), views, and "
            "tensors whose memory another tensor holds (`p.grad.data`) are left alone",
        ),
        "gathered_copy_in_loss": Category(
            ("warning",),
            "a loss was computed from the gathered copy of this rank's own features, which carries no gradient",
            "this rank's own slot of a `dist.all_gather` of a tensor that requires grad (called while gradients are "
            "recorded) reached the loss passed to backward (followed through every torch call computed from it): "
            "all_gather is not differentiable, so the features' gradient misses what they contribute through the "
            "gathered batch. Named at the all_gather. A slot the script puts its own tensor back in, the "
            "differentiable torch.distributed.nn all_gather, a detached input and a gather under no_grad are left alone",
        ),
    },
    rule=collective_arguments,
    watch=ArgumentWatch,
    facts=ArgumentFacts,
)
