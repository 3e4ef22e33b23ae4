"""Typed configuration of a gradsync trainer, validated when it is built.

Each part's options live with the part (`DDPConfig` in gradsync.ddp, `MetricsConfig` in
gradsync.metrics.config, `CheckpointConfig`, `CompressionConfig`); `TrainerConfig` composes
them. Options live in these dataclasses and nowhere else (no hidden environment variables), so
a run is described completely by one `TrainerConfig`. Validation happens at construction,
before any process group exists, so a bad value fails the same way on every rank instead of
hanging one of them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from gradsync.checkpoint.config import CheckpointConfig
from gradsync.ddp import DDPConfig
from gradsync.errors import ConfigError
from gradsync.host_memory import HOST_MEMORY
from gradsync.metrics.config import MetricsConfig
from gradsync.parallel.config import ParallelConfig
from gradsync.sections import section

PRECISIONS = ("fp32", "bf16", "fp16")
DEVICES = ("cpu", "cuda")
BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class TrainerConfig:
    """Everything that shapes a gradsync training run.

    accumulation_steps: micro-batches per optimizer step; gradients are all-reduced once per
        optimizer step (DDP `no_sync` on the others). Auto compression may raise it only when
        `ddp.compression.max_accumulation_steps` allows it.
    precision: "fp32", "bf16" (autocast, no scaler) or "fp16" (autocast and GradScaler; CUDA only).
    max_grad_norm: clip the global gradient norm to this value after unscaling; None disables.
        When set, a step whose gradient norm is not finite is skipped and counted.
    seed: seeds Python, NumPy and torch identically on every rank at setup (so models start
        equal) and, after `prepare`, with a per-rank stream (so dropout and augmentation differ
        across replicas as they would across the samples of one big batch).
    device: "cuda" or "cpu"; None picks CUDA when it is available.
    backend: "nccl" or "gloo"; None picks NCCL for CUDA and Gloo for CPU.
    timeout_s: how long a collective may wait before the backend gives up; None keeps the
        backend's default (NCCL 10 min, Gloo 30 min).
    host_memory: what happens to host memory a step frees: "reuse" keeps it in the process for
        the next step (glibc's malloc otherwise returns it to the OS and every step faults it
        back in, 4-6% of a CPU step measured), "release" leaves the C library's defaults (and
        the trainer then frees each update's gradients at the next backward, as a plain loop
        does), "auto" reuses when the device is the CPU. Process-wide, applied once at setup (gradsync.host_memory).
    run_dir: where metrics and TensorBoard events go; None means ./gradsync_runs/<timestamp>. Under
        `gradsync run` the launcher's folder wins (one run, one folder; see gradsync.rundir).
    checkpoint: when and where to save, and whether to resume (see `CheckpointConfig`).
    parallel: how the model is spread over the ranks: "ddp" (default), "fsdp", "hsdp", "tp",
        "fsdp+tp", or a `ParallelConfig` / dict of its fields. The `ddp` options apply to DDP;
        with the others only `ddp.compression="bf16"` does (FSDP reduces gradients in bf16).
    """

    accumulation_steps: int = 1
    precision: str = "fp32"
    max_grad_norm: float | None = None
    seed: int = 0
    device: str | None = None
    backend: str | None = None
    timeout_s: float | None = None
    host_memory: str = "auto"
    run_dir: str | None = None
    ddp: DDPConfig = field(default_factory=DDPConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, "parallel", ParallelConfig.of(self.parallel))
        object.__setattr__(self, "ddp", section(DDPConfig, self.ddp, "ddp"))
        object.__setattr__(self, "metrics", section(MetricsConfig, self.metrics, "metrics"))
        object.__setattr__(self, "checkpoint", section(CheckpointConfig, self.checkpoint, "checkpoint"))
        if not isinstance(self.accumulation_steps, int) or self.accumulation_steps < 1:
            raise ConfigError(
                f"accumulation_steps={self.accumulation_steps!r}: it counts micro-batches per "
                "optimizer step and must be an integer >= 1 (1 means no accumulation)."
            )
        most = self.ddp.compression.max_accumulation_steps
        if most > 1 and most < 2 * self.accumulation_steps:
            raise ConfigError(
                f"ddp.compression.max_accumulation_steps={most} with accumulation_steps={self.accumulation_steps}: "
                f"auto raises accumulation to multiples of {self.accumulation_steps} (windows stay aligned), so "
                f"allow at least {2 * self.accumulation_steps}, or 1 to keep {self.accumulation_steps}."
            )
        if self.precision not in PRECISIONS:
            raise ConfigError(
                f"precision={self.precision!r} is unknown; use one of {', '.join(PRECISIONS)}."
            )
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ConfigError(
                f"max_grad_norm={self.max_grad_norm!r}: use a positive number, or None to "
                "disable gradient clipping."
            )
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"seed={self.seed!r}: use a non-negative integer.")
        if self.device is not None and self.device not in DEVICES:
            raise ConfigError(
                f"device={self.device!r}: use 'cuda', 'cpu', or None to pick CUDA when available. "
                "The GPU index comes from LOCAL_RANK, set by the launcher."
            )
        if self.backend is not None and self.backend not in BACKENDS:
            raise ConfigError(
                f"backend={self.backend!r}: use 'nccl' (CUDA), 'gloo' (CPU), or None to pick from "
                "the device."
            )
        if self.host_memory not in HOST_MEMORY:
            raise ConfigError(
                f"host_memory={self.host_memory!r}: use 'reuse' (keep freed host memory for the next step), "
                "'release' (the C library's defaults), or 'auto' (reuse on CPU training)."
            )
        self._check_parallel_against_ddp_options()
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ConfigError(
                f"timeout_s={self.timeout_s!r}: use a positive number of seconds, or None for "
                "the backend's default."
            )

    def _check_parallel_against_ddp_options(self) -> None:
        """Options that only mean something under DDP are refused with another strategy, rather
        than silently ignored."""
        strategy = self.parallel.strategy
        if strategy == "ddp":
            return
        pipeline = self.parallel.pipeline
        # A pipeline's ranks agree on overflows (gradsync.precision), so fp16 works there.
        if self.precision == "fp16" and not pipeline:
            raise ConfigError(
                f"precision='fp16' with parallel={strategy!r}: fp16 needs a loss scaler whose overflow check sees "
                "every gradient, and each rank holds only its shard. Use precision='bf16' (no scaler needed)."
            )
        compression = self.ddp.compression.name
        if compression not in ("none", "bf16") or (compression == "bf16" and strategy in ("tp", "pp", "pp+ddp")):
            if strategy == "tp":
                why = "tensor parallelism alone reduces no gradients, so there is nothing to compress."
            elif pipeline:
                why = ("a pipeline's stages reduce their gradients (under 'pp+ddp') inside torch's schedule, where "
                       "gradsync's compression hooks are not installed; compression works with parallel='ddp'.")
            else:
                why = ("FSDP reduce-scatters gradient shards inside its own backward, which DDP's compression hooks "
                       "cannot reach. 'bf16' maps to FSDP's reduce_dtype; int8, top-k and PowerSGD work with parallel='ddp'.")
            raise ConfigError(f"ddp.compression={compression!r} with parallel={strategy!r}: {why}")
        defaults = DDPConfig()
        # "pp+ddp" wraps each stage in DDP, with its bucket size.
        own = ("bucket_cap_mb",) if strategy == "pp+ddp" else ()
        changed = [name for name in ("bucket_cap_mb", "find_unused_parameters", "static_graph", "gradient_as_bucket_view",
                                     "comm_hook", "periodic")
                   if name not in own and getattr(self.ddp, name) != getattr(defaults, name)]
        if changed:
            raise ConfigError(
                f"ddp.{', ddp.'.join(changed)} set with parallel={strategy!r}: these are DDP's options and this "
                "strategy has no such setting. Drop them, or use parallel='ddp'."
            )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "TrainerConfig":
        """Build a config from keyword arguments, naming any unknown option."""
        return section(cls, kwargs, "gradsync.setup()")

    def describe(self) -> dict[str, Any]:
        """A plain, comparable description (callables by name) used to check ranks agree."""

        def plain(value: Any) -> Any:
            if dataclasses.is_dataclass(value):
                return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
            if callable(value):
                return getattr(value, "__qualname__", type(value).__name__)
            if value is None or isinstance(value, (bool, int, float, str)):
                return value
            return type(value).__name__

        return plain(self)
