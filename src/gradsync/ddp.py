"""DDP's options: how `DistributedDataParallel` wraps the model and moves its gradients."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from gradsync.comm.compression import CompressionConfig
from gradsync.comm.periodic import PeriodicSyncConfig
from gradsync.errors import ConfigError
from gradsync.sections import section


@dataclass(frozen=True)
class DDPConfig:
    """Options passed to `DistributedDataParallel` (see its documentation for each one).

    `sync_buffers` broadcasts rank 0's buffers (BatchNorm statistics, ...) to every rank
    before each forward pass; buffers are always made equal once, when the model is wrapped.

    `bucket_cap_mb="auto"` sizes buckets from the model's gradients (about 30 buckets, 1-25 MB).

    `compression` sends gradients through a compressor ("fp16", "bf16", "int8", "topk",
    "powersgd"; see gradsync.comm) or lets "auto" pick one by trying them in the first steps:
    a name, a `CompressionConfig`, or a dict of its fields.

    `periodic` makes each rank take `every` optimizer steps alone and then agree on one model
    (local SGD or DiLoCo; see gradsync.comm.periodic), for links too slow for any compressor.
    It changes the optimisation, so it is off unless asked for: a `PeriodicSyncConfig`, or a
    dict of its fields, e.g. {"every": 16}.

    `comm_hook` is an advanced escape hatch: a DDP communication hook `hook(state, bucket)`
    that gradsync wraps with its own timing, because DDP accepts only one hook per model.
    `comm_hook_state` is its state (default: the process group).
    """

    bucket_cap_mb: float | str = 25.0
    find_unused_parameters: bool = False
    sync_buffers: bool = True
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    periodic: PeriodicSyncConfig = field(default_factory=PeriodicSyncConfig)
    comm_hook: Callable[..., Any] | None = None
    comm_hook_state: Any = None

    def __post_init__(self) -> None:
        compression = self.compression
        if isinstance(compression, str):
            compression = CompressionConfig(name=compression)
        object.__setattr__(self, "compression", section(CompressionConfig, compression, "ddp.compression"))
        object.__setattr__(self, "periodic", section(PeriodicSyncConfig, self.periodic, "ddp.periodic"))
        if self.periodic.enabled and (self.compression.name != "none" or self.comm_hook is not None):
            raise ConfigError(
                f"ddp.periodic.every={self.periodic.every} with "
                + (f"ddp.compression={self.compression.name!r}" if self.compression.name != "none" else "ddp.comm_hook")
                + ": periodic synchronisation sends no gradients, so there is nothing for a gradient hook to do. "
                "Drop one of them."
            )
        if self.comm_hook is not None and self.compression.name != "none":
            raise ConfigError(
                f"ddp.comm_hook and ddp.compression={self.compression.name!r} both set: DDP runs one "
                "hook per model. Drop comm_hook, or set compression='none' and compress inside your hook."
            )
        if self.bucket_cap_mb != "auto" and not (
            isinstance(self.bucket_cap_mb, (int, float)) and not isinstance(self.bucket_cap_mb, bool) and self.bucket_cap_mb > 0
        ):
            raise ConfigError(
                f"ddp.bucket_cap_mb={self.bucket_cap_mb!r}: the gradient bucket size must be a "
                "positive number of megabytes (DDP's default is 25), or 'auto' to size it from the model."
            )
        if self.comm_hook is not None and not callable(self.comm_hook):
            raise ConfigError(
                "ddp.comm_hook must be a DDP communication hook, a callable (state, bucket) -> "
                f"Future; got {type(self.comm_hook).__name__}."
            )
