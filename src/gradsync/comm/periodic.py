"""Synchronising every H optimizer steps instead of every step: local SGD and DiLoCo.

DDP all-reduces the gradients at every step. On a link so slow that even PowerSGD leaves the
step waiting (tens of Mbit/s between sites), the remaining lever is to talk less often. Each
rank takes H optimizer steps on its own data without communicating (DDP's `no_sync`), then
the ranks agree on one model, in one of two ways:

- `"average"`: local SGD (Lin et al., 2018). The parameters are averaged.
- `"diloco"`: DiLoCo (Douillard et al., 2023). Each rank's change since the last agreement is
  averaged into a pseudo-gradient, and an outer optimizer steps with it from the parameters of
  the last agreement. The outer optimizer is SGD with Nesterov momentum (lr 0.7, momentum 0.9,
  as in the paper). With lr 1 and no momentum it is `"average"`.

This changes the optimisation: the ranks' models drift apart between agreements. So it is
never switched on by itself; auto may propose it but never applies it. Floating-point buffers
(BatchNorm's statistics) are averaged at each agreement too.

A period also ends at the end of every epoch and before every checkpoint, so that evaluation,
checkpoints and the final model see one model, the same on every rank. Each rank's own
optimizer state differs from the others', so the trainer checkpoints it per rank
(`Strategy.local_optimizer_state`), and a resumed run continues exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.model_averaging.utils import average_parameters

from gradsync.errors import ConfigError

METHODS = ("average", "diloco")


@dataclass(frozen=True)
class PeriodicSyncConfig:
    """every: optimizer steps each rank takes alone between agreements. The default, 1, is
        DDP's all-reduce of the gradients at every step; the other fields then do nothing.
    method: "average" (local SGD) or "diloco" (an outer Nesterov step on the averaged change).
        "average" is the default because it cannot overshoot: DiLoCo's outer momentum amplifies
        the averaged change about sevenfold, which the paper pairs with hundreds of inner steps;
        with 4 it lost 13.6 points on the digits demo (docs/performance.md).
    outer_lr, outer_momentum: DiLoCo's outer optimizer.
    """

    every: int = 1
    method: str = "average"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ConfigError(
                f"ddp.periodic.every={self.every!r}: use the number of optimizer steps between synchronisations, "
                "an integer >= 1 (1: all-reduce gradients every step, as DDP does)."
            )
        if self.method not in METHODS:
            raise ConfigError(f"ddp.periodic.method={self.method!r}: use one of {', '.join(METHODS)}.")
        if not (isinstance(self.outer_lr, (int, float)) and math.isfinite(self.outer_lr) and self.outer_lr > 0):
            raise ConfigError(f"ddp.periodic.outer_lr={self.outer_lr!r}: use a positive number (DiLoCo used 0.7).")
        if not (isinstance(self.outer_momentum, (int, float)) and 0 <= self.outer_momentum < 1):
            raise ConfigError(f"ddp.periodic.outer_momentum={self.outer_momentum!r}: use a number in [0, 1) (DiLoCo used 0.9).")

    @property
    def enabled(self) -> bool:
        return self.every > 1


class PeriodicSync:
    """Counts optimizer steps and makes the ranks agree on one model every `config.every`.

    `step_done()` after each optimizer step; `synchronise()` to end a period early (epoch end,
    checkpoint). Both are collective: every rank calls them at the same steps.
    """

    def __init__(self, config: PeriodicSyncConfig, module: nn.Module, process_group: Any = None) -> None:
        self.config = config
        self.process_group = process_group
        self.parameters = [p for p in module.parameters() if p.requires_grad]  # frozen ones never change
        self.buffers = [b for b in module.buffers() if b.is_floating_point()]
        self.steps_since = 0  # optimizer steps since the ranks last agreed
        self.synchronisations = 0
        self.sent_bytes = 0  # what this rank handed to the all-reduces
        self.anchor: list[torch.Tensor] = []
        self.outer: torch.optim.Optimizer | None = None
        if config.method == "diloco":
            # The model the ranks agreed on last, and the outer optimizer that steps it: a second copy
            # of the parameters, plus one of momentum.
            self.anchor = [p.detach().clone() for p in self.parameters]
            momentum = config.outer_momentum
            self.outer = torch.optim.SGD(self.anchor, lr=config.outer_lr, momentum=momentum, nesterov=momentum > 0)

    def step_done(self) -> bool:
        """After an optimizer step: True if this one ended a period (the ranks agreed)."""
        self.steps_since += 1
        if self.steps_since < self.config.every:
            return False
        return self.synchronise()

    @torch.no_grad()
    def synchronise(self) -> bool:
        """Agree on one model now; False if the ranks already hold one (no step since the last)."""
        if self.steps_since == 0:
            return False
        if self.outer is None:
            self._average(self.parameters)
        else:
            # The pseudo-gradient: how far each rank moved from the agreed model, averaged.
            moved = [anchor - p for anchor, p in zip(self.anchor, self.parameters)]
            self._average(moved)
            for anchor, change in zip(self.anchor, moved):
                anchor.grad = change
            self.outer.step()
            self.outer.zero_grad(set_to_none=True)
            for p, anchor in zip(self.parameters, self.anchor):
                p.copy_(anchor)
        if self.buffers:
            self._average(self.buffers)
        self.steps_since = 0
        self.synchronisations += 1
        return True

    def _average(self, tensors: list[torch.Tensor]) -> None:
        # torch's own averaging (one flat all-reduce); it rebinds each tensor's data to the result.
        self.sent_bytes += sum(t.numel() * t.element_size() for t in tensors)
        average_parameters(iter(tensors), self.process_group)

    def state_dict(self) -> dict[str, Any]:
        return {
            "steps_since": self.steps_since,
            "synchronisations": self.synchronisations,
            "anchor": [a.detach().to("cpu", copy=True) for a in self.anchor],
            "outer": self.outer.state_dict() if self.outer is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["outer"] is None) != (self.outer is None) or len(state["anchor"]) != len(self.anchor):
            raise ConfigError(
                f"the checkpoint's periodic synchronisation is not this run's (ddp.periodic.method={self.config.method!r}): "
                "resume with the method the checkpointed run used."
            )
        self.steps_since, self.synchronisations = state["steps_since"], state["synchronisations"]
        with torch.no_grad():
            for anchor, saved in zip(self.anchor, state["anchor"]):
                anchor.copy_(saved)
        if self.outer is not None:
            self.outer.load_state_dict(state["outer"])
