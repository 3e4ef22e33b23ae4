"""Agreed control flow: decisions one rank takes, acted on by every rank together.

Data-parallel ranks must run the same collectives in the same order. A rank that skips a batch,
stops early or bails out on a NaN alone leaves its peers waiting in a collective until the
backend times out. These helpers turn a local decision into a global one with a single small
all-reduce, before anyone acts on it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gradsync.distributed import collective_device
from gradsync.errors import GradsyncError, PeerError


def _active(group: Any) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _agree(flag: bool | torch.Tensor, op: dist.ReduceOp, group: Any) -> bool:
    if isinstance(flag, torch.Tensor) and flag.numel() != 1:
        raise GradsyncError(
            f"agreement takes one boolean per rank; got a tensor of shape {tuple(flag.shape)}. "
            "Reduce it first, e.g. flag.any()."
        )
    if not _active(group):
        return bool(flag)
    device = collective_device(group)
    if isinstance(flag, torch.Tensor):
        # Stays on the device until the reduction: no host sync before the collective.
        vote = flag.detach().reshape(1).to(device=device, dtype=torch.int32)
    else:
        vote = torch.tensor([int(bool(flag))], dtype=torch.int32, device=device)
    dist.all_reduce(vote, op=op, group=group)
    return bool(vote.item())


def agree_any(flag: bool | torch.Tensor, group: Any = None) -> bool:
    """True on every rank if `flag` is true on at least one rank.

    Use it for decisions any single rank may take for everyone: skip this batch, stop early,
    this loss is not finite. Every rank must call it at the same point.
    """
    return _agree(flag, dist.ReduceOp.MAX, group)


def agree_all(flag: bool | torch.Tensor, group: Any = None) -> bool:
    """True on every rank only if `flag` is true on every rank (e.g. "everyone is ready")."""
    return _agree(flag, dist.ReduceOp.MIN, group)


def raise_if_any_rank_failed(error: Exception | None, group: Any = None) -> None:
    """Raise on every rank when any rank found an error, so none is left waiting in a collective.

    The failing rank raises its own error; the others raise a PeerError quoting it.
    """
    if not _active(group):
        if error is not None:
            raise error
        return
    reports: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, None if error is None else str(error), group=group)
    if error is not None:
        raise error
    failed = [(rank, message) for rank, message in enumerate(reports) if message is not None]
    if failed:
        rank, message = failed[0]
        others = f" (and {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
        raise PeerError(f"rank {rank}{others} stopped with: {message}")
