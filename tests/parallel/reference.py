"""The one-process reference that the strategies' tests hold training to: SGD on each optimizer
step's mean loss over every sample the data-parallel ranks applied in it, clipped."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def one_process_sgd(results: list[dict[str, Any]], model: nn.Module, x: torch.Tensor, y: torch.Tensor, lr: float,
                    clip: float) -> nn.Module:
    """`model` trained in place on the (step, sample indexes) each result's `applied` lists; the
    ranks that share a `data_rank` (a tensor-parallel group, a pipeline) share their samples."""
    steps: dict[int, list[int]] = {}
    for result in {r["data_rank"]: r for r in results}.values():
        for step, indices in result["applied"]:
            steps.setdefault(step, []).extend(indices)
    for step in sorted(steps):
        idx = torch.tensor(steps[step])
        model.zero_grad()
        F.mse_loss(model(x[idx]), y[idx]).backward()
        nn.utils.clip_grad_norm_(model.parameters(), clip)
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
    return model
