"""loss_scale: a loss divided by the world size although DDP already averages the gradients.

DDP averages gradients over the ranks; a loss that also divides by the world size makes every
update 1/world of the one-process update, and the learning rate falls as ranks are added. Read
from the autograd graph down to the loss's reduction; an accumulation over as many micro-steps as
ranks is scaled the same way, and is not judged.
"""

from __future__ import annotations

import re
import statistics
import warnings
from typing import Any, TypedDict

import torch

from gradsync.rundir.records import Finding
from gradsync.callsite import OWN, caller_location, file_kind, short_path
from gradsync.run.check_primitives import Patches
from gradsync.run.harmless import BookkeepingByKind
from gradsync.run.moments import Moments
from gradsync.doctor.script.shared_facts import own_facts
from gradsync.doctor.script.unit import Category, Check, RankFacts

NAME = "loss_scale"
LOSS_WALKS = 8  # backward calls whose loss normalisation is read
MAX_STEPS = 64  # optimizer steps whose backward calls are counted
_GRAPH_NODES = 16  # autograd nodes walked down from a loss to its reduction


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


class LossFacts(TypedDict):
    """What the watch records on one rank (under "loss_scale" in its facts file)."""

    loss_walks: list[dict[str, Any]]  # {"site", "step", "scale", "reduction", "elements", "factor", "factor_site"}
    backwards_per_step: list[int]


class LossWatch:
    """How each loss passed to backward on one rank is normalised, and its backward calls per
    optimizer step (an accumulation's micro-steps)."""

    def __init__(self, moments: Moments, bookkeeping: BookkeepingByKind) -> None:
        self.moments = moments
        self.bookkeeping = bookkeeping[f"the {NAME} check's watch"]
        self.loss_walks: list[dict[str, Any]] = []
        self.backwards_per_step: list[int] = []
        self._backwards = 0  # since the last optimizer step
        self._tracing_graph = False  # anomaly mode switched on by this watch, until the first backward
        moments.on("wrapped", self._wrapped, self.bookkeeping)
        moments.on("backward", self._backward, self.bookkeeping)
        moments.on("step_starts", self._step_starts, self.bookkeeping)
        moments.on("step_ends", self._step_ends, self.bookkeeping)

    def install(self, patches: Patches) -> None:
        """Nothing beyond the host's moments."""

    def _wrapped(self, ddp: Any, site: str | None) -> None:
        if len(self.moments.models) == 1 and not torch.is_anomaly_enabled():
            # Until the first backward, autograd keeps each node's forward traceback, so a loss
            # divided by the world size is named at the division's own line: one step's cost.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # its "will increase the runtime" is ours to pay, not news
                torch.autograd.set_detect_anomaly(True, check_nan=False)
            self._tracing_graph = True

    def _stop_tracing_graph(self) -> None:
        if self._tracing_graph:
            torch.autograd.set_detect_anomaly(False)
            self._tracing_graph = False

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

    def _step_starts(self, optimizer: Any, step: int) -> None:
        self._stop_tracing_graph()  # a step without a backward seen (autograd.grad, a closure)

    def _step_ends(self, optimizer: Any, step: int) -> None:
        if len(self.backwards_per_step) < MAX_STEPS:
            self.backwards_per_step.append(self._backwards)
        self._backwards = 0

    def facts(self) -> LossFacts:
        return {"loss_walks": self.loss_walks, "backwards_per_step": self.backwards_per_step}


_SCALE_TOLERANCE = 1e-4  # relative: a loss scale equal to 1/world size up to float rounding


def _close(value: float, target: float) -> bool:
    return abs(value - target) <= _SCALE_TOLERANCE * abs(target)


def loss_divided_by_world_size(checks: RankFacts) -> list[Finding]:
    recorded = own_facts(checks, NAME)
    if recorded is None:
        return []
    world = len(checks)
    findings = []
    for rank, facts in sorted(recorded.items()):
        walks = [w for w in facts["loss_walks"] if w.get("scale") is not None]
        micro = statistics.median(facts["backwards_per_step"]) if facts["backwards_per_step"] else 1
        if not walks or _close(1 / world, 1 / micro) or _close(1 / world, 1.0):
            continue  # an accumulation over as many micro-steps as ranks is scaled the same way
        if not all(_close(w["scale"], 1 / world) or _close(w["scale"], 1 / (world * micro)) for w in walks):
            continue
        site = walks[0]["site"] or "?"
        division = walks[0].get("factor_site")  # where the constant factor was applied, when anomaly mode saw it
        reduction = "sum" if walks[0]["reduction"] == "sum" else "mean"
        findings.append(Finding(
            "loss_scaled_by_world_size",
            "warning",
            sorted(checks),
            f"The loss passed to backward at {site} is the {reduction} over this rank's {walks[0]['elements']} "
            f"samples (or elements) times {walks[0]['factor']:.6g}"
            f"{f' (the factor applied at {division})' if division else ''}: with {world} ranks that is 1/{world} of "
            "this rank's mean loss, as if normalised by the global batch. DDP already averages the gradients over the "
            f"ranks, so every update is 1/{world} of the intended one, and the effective learning rate falls as ranks "
            "are added.",
            "Normalise the loss as on one process, by this rank's own batch (the mean over its samples): DDP's "
            "average over ranks then gives the mean over the global batch. Divide only by the accumulation steps.",
            locations={str(r): division or site for r in sorted(checks)},
            details={"scale": walks[0]["scale"], "world_size": world},
        ))
        break  # the same code on every rank: one finding
    return findings


CHECK = Check(
    name="loss_scale",
    summary="a loss divided by the world size (DDP averages already)",
    categories={
        "loss_scaled_by_world_size": Category(
            ("warning",),
            "the loss divides by the world size although DDP averages: updates 1/world",
            "the loss passed to backward is a mean (or a sum over the local batch) times 1/world size, read from "
            "the autograd graph down to its reduction: every update is 1/world of the intended one. Not judged "
            "when the accumulation steps equal the world size, or when the loss adds terms",
        ),
    },
    rule=loss_divided_by_world_size,
    watch=LossWatch,
    facts=LossFacts,
)
