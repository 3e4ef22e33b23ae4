"""Mixed precision: autocast for the forward pass, loss scaling for fp16, and the optimizer step.

bf16 keeps fp32's exponent range, so it needs autocast only. fp16 overflows easily, so its
loss is scaled (GradScaler) and gradients are unscaled before anything reads them (clipping,
norms); a step whose gradients overflowed is skipped by the scaler, and gradsync reports that
rather than letting it pass unnoticed.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager

import torch

from gradsync.errors import ConfigError

_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_precision_supported(precision: str, device: torch.device) -> None:
    """Reject precisions this device cannot train in, with what to use instead."""
    if precision == "fp16" and device.type != "cuda":
        raise ConfigError(
            "precision='fp16' needs a CUDA device: on the CPU fp16 autocast covers few ops and "
            "runs slowly. Use precision='bf16' (no loss scaling needed) or 'fp32'."
        )
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"precision='bf16' is not supported by {torch.cuda.get_device_name(device)}; use "
            "precision='fp16' (with loss scaling) or 'fp32'."
        )


class MixedPrecision:
    """Autocast, loss scaling and the scaled optimizer step for one precision on one device."""

    def __init__(self, precision: str, device: torch.device, agree_on_overflow: bool = False) -> None:
        self.precision = precision
        self.device_type = device.type
        self.dtype = _DTYPES[precision]
        # Loss scaling only helps fp16; bf16 has the range of fp32. `agree_on_overflow`: ranks hold
        # different parameters (a pipeline's stages), so the scaler all-reduces whether any rank
        # found inf/NaN, and every rank skips that step and lowers its scale alike.
        self.scaler: torch.amp.GradScaler | None = None
        self._scale_ready = False  # loss_scale() made the scaler create its scale
        if precision == "fp16":
            if agree_on_overflow:
                from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

                self.scaler = ShardedGradScaler(device.type)
            else:
                self.scaler = torch.amp.GradScaler(device.type)

    def loss_scale(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """What multiplies a loss before its backward (fp16's scale), for a backward run
        elsewhere (a pipeline's last stage); None without loss scaling. Every rank's scaler is
        readied here, the ones that never see a loss too."""
        if self.scaler is None:
            return None
        if not self._scale_ready:
            self.scaler.scale(torch.zeros((), device=self.device_type))  # creates the scale on first use
            self._scale_ready = True
        return self.scaler.scale

    def autocast(self) -> ContextManager[Any]:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        # Backward runs outside autocast (as PyTorch recommends): its ops follow the dtypes
        # chosen in the forward pass anyway.
        with torch.autocast(self.device_type, enabled=False):
            (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients back to their true scale, before clipping or measuring them."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, grads_finite: bool = True) -> bool:
        """Run the optimizer step; False when it was skipped because gradients were not finite.

        With fp16 the scaler decides (it skips on inf/NaN and lowers the scale); otherwise the
        caller's own finiteness check does.
        """
        if self.scaler is None:
            if grads_finite:
                optimizer.step()
            return grads_finite
        scale_before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        # The scaler lowers its scale exactly when it found inf/NaN and skipped the step.
        return self.scaler.get_scale() >= scale_before

    def state_dict(self) -> dict[str, Any]:
        return {} if self.scaler is None else {"scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
