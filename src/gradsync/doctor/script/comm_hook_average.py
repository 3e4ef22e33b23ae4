"""comm_hook_average: a DDP communication hook returns the ranks' average of each gradient bucket.

DDP hands a comm hook each bucket holding this rank's gradients and copies what the hook's future
returns into `.grad`. Whatever the hook does on the way (compress, cast, all_reduce), what it
returns must be the average over the ranks: DDP divides nothing afterwards. A hook written from
the docs' skeleton that all-reduces and forgets the division returns the sum; one that divides by
the global world size while the model spans a subgroup returns a fraction. Every rank receives the
same scaled gradient, so the replicas agree and nothing fails: every update is that many times
the intended one (with Adam, whose steps ignore scale, it hides until gradient clipping or weight
decay meets it).

So each rank samples (256 evenly strided values) every bucket its first reductions hand a hook,
before the hook runs, and the same positions of the tensor the hook's future returned, once the
backward is over, with the lines of the collectives the hook called. Sampling commutes with averaging, so the rule averages
the ranks' input samples and compares: a result that is c times that average, with the same c in
every bucket compared and c not 1, is named at the hook's collective. A hook that compresses
(PowerSGD, top-k) returns no multiple of the average and is left alone; so is one that matches it.

Cost: per bucket of the first REDUCTIONS_SAMPLED reductions, 512 values read.
"""

from __future__ import annotations

import math
import threading
from typing import Any, TypedDict

import torch

from gradsync.callsite import short_path
from gradsync.doctor.script.compare import ranks_text
from gradsync.doctor.script.shared_facts import own_facts, replica_groups
from gradsync.doctor.script.unit import Category, Check, RankFacts
from gradsync.run.check_primitives import FINGERPRINT_SAMPLES, Patches, group_ranks
from gradsync.run.harmless import BookkeepingByKind
from gradsync.run.moments import Moments
from gradsync.rundir.records import Finding

NAME = "comm_hook_average"
REDUCTIONS_SAMPLED = 32  # buckets sampled per rank, from the first reductions on
_SAME_SCALE = 0.02  # relative tolerance on the scale (a cast to fp16 or bf16 on the way stays within it)
_LINEAR = 0.02  # relative residual under which the result is a multiple of the average
_MIN_COMPARED = 2  # buckets that must agree on the scale before it is said


class CommHookFacts(TypedDict):
    """What the watch records on one rank (under "comm_hook_average" in its facts file)."""

    # per sampled bucket: {"bucket", "numel", "group", "hook", "hook_at", "registered_at", "own",
    #  "input": its values handed to the hook, "output": the same positions of the result (None: the
    #  backward did not return), "sites": the lines of the collectives the hook called}
    reductions: list[dict[str, Any]]


def _sample(tensor: torch.Tensor) -> list[float]:
    flat = tensor.detach().reshape(-1)
    stride = max(1, flat.numel() // FINGERPRINT_SAMPLES)
    return flat[::stride][:FINGERPRINT_SAMPLES].double().tolist()


def _defined_at(hook: Any) -> str | None:
    code = getattr(hook, "__code__", None)
    return f"{short_path(code.co_filename)}:{code.co_firstlineno}" if code is not None else None


class CommHookWatch:
    """The buckets handed to each comm hook on one rank, and what the hook returned for them."""

    def __init__(self, moments: Moments, bookkeeping: BookkeepingByKind) -> None:
        self.bookkeeping = bookkeeping[f"the {NAME} check's watch"]
        self.reductions: list[dict[str, Any]] = []
        self._in_hook: dict[int, dict[str, Any]] = {}  # thread -> the bucket its hook is reducing now
        self._issued: list[tuple[dict[str, Any], Any]] = []  # (sampled bucket, its hook's future) this backward
        moments.on("bucket_reduction", self._bucket, self.bookkeeping)
        moments.on("backward_ends", self._backward_ends, self.bookkeeping)
        moments.on("collective", self._collective, self.bookkeeping)

    def install(self, patches: Patches) -> None:
        """Nothing beyond the host's moments."""

    def _bucket(self, bucket: Any, reduction: Any) -> None:
        thread = threading.get_ident()
        if reduction.future is None:  # handed to the hook: sample what this rank brings
            if len(self.reductions) >= REDUCTIONS_SAMPLED:
                return
            entry = {"bucket": bucket.index(), "numel": bucket.buffer().numel(), "group": group_ranks(reduction.group),
                     "hook": getattr(reduction.hook, "__qualname__", "?"), "hook_at": _defined_at(reduction.hook),
                     "registered_at": reduction.registered_at, "own": reduction.own,
                     "input": _sample(bucket.buffer()), "output": None, "sites": []}
            self.reductions.append(entry)
            self._in_hook[thread] = entry
            return
        entry = self._in_hook.pop(thread, None)
        if entry is not None and hasattr(reduction.future, "done"):
            self._issued.append((entry, reduction.future))

    def _backward_ends(self, synchronised: bool) -> None:
        # DDP waited for every hook's future before the backward returned and copied the results
        # into the gradients; what the futures hold now is what the hooks returned, and nothing has
        # touched it yet (a clip or the next backward comes later). Read here, not in a callback on
        # the future, which may run after the next backward has refilled the bucket.
        issued, self._issued = self._issued, []
        self._in_hook.clear()  # a hook that raised never said it returned: no collective after this is its
        for entry, future in issued:
            if future.done():
                value = future.value()
                entry["output"] = _sample(value[0] if isinstance(value, (list, tuple)) else value)

    def _collective(self, op: str, args: tuple, kwargs: dict, site: str | None) -> None:
        entry = self._in_hook.get(threading.get_ident())
        if entry is not None and site is not None and site not in entry["sites"]:
            entry["sites"].append(site)

    def facts(self) -> CommHookFacts:
        return {"reductions": self.reductions}


_UNDECIDED = object()  # the bucket says nothing: its average is (nearly) zero


def _scale(result: list[float], average: list[float], inputs: list[list[float]]) -> Any:
    """c such that result = c * average; None where the result is no multiple of it; _UNDECIDED
    where the average is too small beside the ranks' own gradients to tell (they cancel, or the
    bucket holds parameters no forward used)."""
    norm = sum(a * a for a in average)
    largest = max(sum(v * v for v in values) for values in inputs)
    if norm == 0.0 or norm < 1e-4 * largest:
        return _UNDECIDED
    result_norm = sum(r * r for r in result)
    c = sum(r * a for r, a in zip(result, average)) / norm
    residual = sum((r - c * a) ** 2 for r, a in zip(result, average))
    return c if result_norm > 0.0 and math.sqrt(residual) <= _LINEAR * math.sqrt(result_norm) else None


def comm_hook_scales(checks: RankFacts) -> list[Finding]:
    recorded = own_facts(checks, NAME)
    if recorded is None:
        return []
    hooked = {rank: [r for r in facts["reductions"] if not r["own"]] for rank, facts in recorded.items()}
    groups = {rank: (reductions[0]["group"] if reductions else None) for rank, reductions in hooked.items()}
    for members in replica_groups(groups):
        found = _scaled({rank: hooked[rank] for rank in members})
        if found:
            return found
    return []


def _scaled(hooked: dict[int, list[dict[str, Any]]]) -> list[Finding]:
    scales: list[float] = []
    first: dict[int, dict[str, Any]] | None = None
    for index in range(min(len(r) for r in hooked.values())):
        by_rank = {rank: r[index] for rank, r in hooked.items()}
        if any(r["output"] is None for r in by_rank.values()) or len({(r["bucket"], r["numel"]) for r in by_rank.values()}) > 1:
            continue
        inputs = [r["input"] for r in by_rank.values()]
        average = [sum(values) / len(values) for values in zip(*inputs)]
        bucket_scales = [_scale(record["output"], average, inputs) for record in by_rank.values()]
        if any(c is _UNDECIDED for c in bucket_scales):
            continue
        if None in bucket_scales:
            return []  # not a multiple of the average (compression): nothing this check can say
        scales.extend(bucket_scales)
        first = first or by_rank
    if first is None or len(scales) < _MIN_COMPARED * len(hooked):
        return []
    scale = sum(scales) / len(scales)
    if any(abs(c - scale) > _SAME_SCALE * abs(scale) for c in scales) or abs(scale - 1.0) <= _SAME_SCALE:
        return []
    ranks = sorted(hooked)
    size = len(ranks)
    record = first[ranks[0]]
    what = (f"the sum of the ranks' gradients ({scale:.3g} times their average): it reduced them and nothing divided "
            f"by the {size} ranks" if abs(scale - size) <= _SAME_SCALE * size else
            f"{scale:.3g} times the ranks' average gradient")
    hook = f"`{record['hook']}`" + (f" (registered at {record['registered_at']})" if record["registered_at"] else "")
    located = {rank: (r["sites"][0] if r["sites"] else r["hook_at"] or r["registered_at"] or "?") for rank, r in first.items()}
    return [Finding(
        "comm_hook_scales_gradients",
        "error",
        ranks,
        f"The DDP communication hook {hook} returned {what}, in every one of the {len(scales) // size} buckets "
        f"compared (the first at {located[ranks[0]]}). DDP copies what the hook returns into the gradients and "
        f"divides nothing afterwards, so every update on {ranks_text(ranks)} is {scale:.3g} times the intended one; "
        "the replicas still agree, and nothing fails.",
        "Return the average from the hook: divide the bucket by the process group's size "
        "(`bucket.buffer().div_(group.size())` before the all_reduce, or in the future's `.then`), as torch's "
        "`default_hooks.allreduce_hook` does, or all_reduce with `op=ReduceOp.AVG` where the backend has it.",
        locations={str(rank): site for rank, site in sorted(located.items())},
        details={"scale": scale, "buckets_compared": len(scales) // size, "hook": record["hook"]},
    )]


CHECK = Check(
    name=NAME,
    summary="a DDP comm hook returns the ranks' average, not a multiple of it",
    categories={
        "comm_hook_scales_gradients": Category(
            ("error",),
            "a DDP communication hook returned a multiple of the ranks' average gradient (a sum: no division)",
            "a Python comm hook returned, in every bucket compared, the ranks' average gradient times the same "
            "factor other than 1 (the sum, when it all-reduces without dividing by the world size; a fraction, "
            "when it divides by more ranks than the model spans). Named at the hook's collective. A hook that "
            "compresses (PowerSGD) returns no multiple of the average and is left alone",
        ),
    },
    rule=comm_hook_scales,
    watch=CommHookWatch,
    facts=CommHookFacts,
)
