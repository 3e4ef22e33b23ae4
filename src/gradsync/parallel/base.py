"""The interface every parallelism strategy implements, so the trainer never asks which one runs.

A strategy owns what differs between DDP, FSDP2 and tensor parallelism: how the model is
wrapped, how a micro-step keeps gradients local, how gradients left unreduced (a skipped
window boundary) are reduced, the gradient norm, which ranks share a batch, what its
checkpointed state is and which communication it measures.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ContextManager

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    import logging

    from gradsync.distributed import DistContext
    from gradsync.metrics import Clock, StepRecord


@dataclass
class Placement:
    """Where this rank stands among the copies of the data: ranks of one data-parallel rank
    (a tensor-parallel group) see the same batches, draw the same random numbers."""

    data_rank: int
    data_world_size: int
    data_group: Any = None  # the group sums over data-parallel ranks run on (None: every rank)
    # One rank per group counts its samples in the metrics, so throughput counts each sample once.
    counts_samples: bool = True


class Strategy:
    """One way to spread the model over the ranks (see gradsync.parallel for the ones there are).

    `config` is the run's TrainerConfig (not imported here: gradsync.config imports this package's
    options, so the strategies take the config they are given).
    """

    name = ""
    # True when parameters and optimizer state are DTensors: checkpoints save the optimizer
    # state sharded (each rank its part) instead of once, and load it resharded.
    sharded = False
    # True when every rank must run every forward (a forward gathers parameters or exchanges
    # activations): evaluation batches are then spread so that every rank gets as many.
    lockstep_forward = False
    # False when the strategy casts to bf16 itself (FSDP's MixedPrecisionPolicy), not autocast.
    autocast = True
    # True when ranks hold different layers (a pipeline's stages): checkpoints keep optimizer
    # state per parameter name, written by the ranks that hold it.
    staged = False

    def __init__(self, config: Any, dist_context: DistContext, clock: Clock, logger: logging.Logger) -> None:
        self.config = config
        self.dist = dist_context
        self.clock = clock
        self.logger = logger
        self.placement = Placement(dist_context.rank, dist_context.world_size)
        self.compression: Any = None  # DDP's compression hook or auto tuner; None elsewhere

    # -- wrapping ------------------------------------------------------------------------

    def wrap(self, model: nn.Module) -> nn.Module:
        """The model to call in the loop (the user's module may be changed in place)."""
        raise NotImplementedError

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The module to evaluate with (Trainer.unwrap)."""
        return model

    def trained_module(self, model: nn.Module) -> nn.Module:
        """The module whose parameters this rank trains, by their names in the user's model:
        the user's module (sharded in place under FSDP and TP), or a pipeline rank's stages."""
        return self.unwrap(model)

    # -- a micro-step ----------------------------------------------------------------------

    def start_window(self, step: int) -> None:
        """Called when optimizer step `step` (counted from 1) starts accumulating: waits noted
        since the last step (evaluation's gathers) are not this step's."""
        self.take_exposed()

    def micro_step(self, synced: bool) -> ContextManager[None]:
        """Entered before a micro-batch's forward: `synced` False keeps its gradients local."""
        return contextlib.nullcontext()

    def backward(self, record: StepRecord, synced: bool) -> ContextManager[None]:
        """Around a micro-batch's backward: notes the communication it left exposed in `record`."""
        return contextlib.nullcontext()

    def reduce_unsynced(self) -> bool:
        """Reduce gradients that no synced backward reduced (the window's boundary batch was
        skipped); True when something was sent."""
        return False

    @property
    def reductions(self) -> int:
        """Gradient reduction passes so far (one per synced backward, one per `reduce_unsynced`)."""
        return 0

    def comm_counters(self) -> dict[str, float]:
        """Running totals of bytes communicated (and codec time); a step's are the difference."""
        return {}

    def take_exposed(self) -> list[tuple[Any, Any]]:
        """Intervals since the last call in which training waited on communication outside
        backward (FSDP's forward all-gathers, tensor parallelism's exchanges)."""
        return []

    def exposed_estimate_s(self) -> float:
        """Seconds of exposed communication estimated (not measured) for the step just closed."""
        return 0.0

    # -- the update --------------------------------------------------------------------------

    def clip_grad_norm(self, parameters: list[nn.Parameter], max_norm: float) -> float:
        """Clip the global gradient norm; returns it (the same on every rank)."""
        return float(nn.utils.clip_grad_norm_(parameters, max_norm))

    def after_update(self) -> None:
        """Called after each optimizer step closes (applied or skipped)."""

    def end_epoch(self) -> None:
        """Called after an epoch's last optimizer step, before the loop's end-of-epoch code."""

    # -- checkpoints ---------------------------------------------------------------------------

    @property
    def local_optimizer_state(self) -> bool:
        """Whether each rank's optimizer state is its own (not a replica), so checkpoints keep it per rank."""
        return False

    def before_checkpoint(self) -> None:
        """Called (on every rank) before a checkpoint's state is taken."""

    def state_dict(self) -> dict[str, Any]:
        """This rank's strategy state for checkpoints (compression residuals, DDP's bucket order)."""
        return {}

    def load_state_dict(self, own: dict[str, Any]) -> None:
        """Restore `state_dict()`'s state from a checkpoint's rank state (same world size only)."""

    def explain(self, error: BaseException) -> Exception | None:
        """A clearer error for one this strategy's library raised, or None."""
        return None

    def describe(self) -> dict[str, Any]:
        """What the strategy chose (mesh, units), for the summary."""
        return {"strategy": self.name}


def clip_dtensor_aware(parameters: list[nn.Parameter], max_norm: float) -> float:
    """The global gradient norm over plain tensors and DTensors on any meshes, then clipping.

    `clip_grad_norm_` stacks per-tensor norms, which fails when DTensors live on different
    meshes (FSDP over data-parallel ranks, tensor parallelism within a node: parameters outside
    the TP plan are sharded on one mesh, the others on two). Norms are taken per mesh; a
    DTensor's comes back partial and is completed by `full_tensor()`, a plain (replicated)
    tensor's is counted once.
    """
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    by_mesh: dict[Any, list[torch.Tensor]] = defaultdict(list)
    for grad in grads:
        by_mesh[grad.device_mesh if isinstance(grad, DTensor) else None].append(grad)
    squares = 0.0
    for mesh, group in by_mesh.items():
        norm = nn.utils.get_total_norm(group, 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares += float(norm) ** 2
    total = math.sqrt(squares)
    scale_to_norm(grads, total, max_norm)
    return total


def scale_to_norm(grads: list[torch.Tensor], total: float, max_norm: float) -> None:
    """Scale `grads`, whose global norm is `total`, down to `max_norm` (clip_grad_norm_'s own formula)."""
    coefficient = max_norm / (total + 1e-6)
    if coefficient < 1.0:
        for grad in grads:
            grad.mul_(coefficient)


def average_gradients(parameters: list[nn.Parameter], group: Any, size: int) -> None:
    """Average the parameters' gradients over `group` (of `size` ranks) by hand, one all-reduce
    per dtype; a rank without a gradient for a parameter contributes zeros."""
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = defaultdict(list)
    for p in parameters:
        by_dtype[p.dtype].append(p)
    for same in by_dtype.values():
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in same])
        dist.all_reduce(flat, group=group)
        flat.div_(size)
        offset = 0
        for p in same:
            p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()


def step_mixed_groups_one_by_one(optimizer: torch.optim.Optimizer) -> list[int]:
    """Turn off the multi-tensor kernels of param groups that hold DTensors beside plain tensors;
    return those groups' indexes.

    Tensor parallelism turns only the planned layers' parameters into DTensors; the rest stay
    plain tensors. On CUDA torch's optimizers default to their `foreach` kernels, and one
    `_foreach_*` call cannot take both kinds ("got mixed torch.Tensor and DTensor"), so the
    first `optimizer.step()` fails. The per-parameter loop computes the same update; only
    the groups that mix the two lose the multi-tensor speed-up (the `fused` kernels refuse the
    mix the same way, so they are turned off too).
    """
    from torch.distributed.tensor import DTensor

    changed = []
    for index, group in enumerate(optimizer.param_groups):
        kinds = {isinstance(p, DTensor) for p in group["params"]}
        if len(kinds) < 2 or (group.get("foreach") is False and not group.get("fused")):
            continue
        if "foreach" in group:
            group["foreach"] = False
        if group.get("fused"):
            group["fused"] = False
        changed.append(index)
    return changed


@dataclass
class CommTally:
    """Bytes, calls and blocking intervals of one kind of communication."""

    bytes: float = 0.0
    calls: int = 0
    spans: list[tuple[Any, Any]] = field(default_factory=list)


def tally_counters(kinds: dict[str, CommTally]) -> dict[str, float]:
    """Running byte totals by kind ("all_gather_bytes", ...) and in all (raw = sent: no compression)."""
    by_kind = {f"{kind}_bytes": tally.bytes for kind, tally in kinds.items()}
    total = sum(by_kind.values())
    return {"raw_bytes": total, "sent_bytes": total, **by_kind}
