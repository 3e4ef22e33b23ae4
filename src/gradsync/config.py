"""Typed configuration of a gradsync trainer, validated when it is built.

Options live here and nowhere else (no hidden environment variables), so a run is described
completely by one `TrainerConfig`. Validation happens at construction, before any process
group exists, so a bad value fails the same way on every rank instead of hanging one of them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from gradsync.checkpoint.config import CheckpointConfig
from gradsync.comm.compression import CompressionConfig
from gradsync.errors import ConfigError
from gradsync.profiling.capture import parse_profile_steps

PRECISIONS = ("fp32", "bf16", "fp16")
DEVICES = ("cpu", "cuda")
BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class DDPConfig:
    """Options passed to `DistributedDataParallel` (see its documentation for each one).

    `sync_buffers` broadcasts rank 0's buffers (BatchNorm statistics, ...) to every rank
    before each forward pass; buffers are always made equal once, when the model is wrapped.

    `bucket_cap_mb="auto"` sizes buckets from the model's gradients (about 30 buckets, 1-25 MB).

    `compression` sends gradients through a compressor ("fp16", "bf16", "int8", "topk",
    "powersgd"; see gradsync.comm) or lets "auto" pick one by trying them in the first steps:
    a name, a `CompressionConfig`, or a dict of its fields.

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
    comm_hook: Callable[..., Any] | None = None
    comm_hook_state: Any = None

    def __post_init__(self) -> None:
        compression = self.compression
        if isinstance(compression, str):
            compression = CompressionConfig(name=compression)
        object.__setattr__(self, "compression", _section(CompressionConfig, compression, "ddp.compression"))
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


@dataclass(frozen=True)
class MetricsConfig:
    """Where and how often per-step metrics are written.

    Metrics are gathered across ranks once every `log_every` optimizer steps (one small
    collective), then written by rank 0 as JSON lines and TensorBoard events.
    `progress` draws a progress bar on rank 0 when its output is a terminal and prints a
    log line every `log_every` steps otherwise.
    `system_every_s`: every rank samples its CPU, memory, network and (with NVML) GPU this
    often on a background thread; the means travel with the next gather. None turns it off.
    `profile_steps`: "A:B" records optimizer steps A..B (from 1, both included) with
    torch.profiler on every rank and writes RUN_DIR/profile/rank{r}.trace.json (Chrome trace)
    and the step-time breakdown rank{r}.breakdown.json (see gradsync.profiling).
    """

    log_every: int = 10
    tensorboard: bool = True
    jsonl: bool = True
    progress: bool = True
    system_every_s: float | None = 1.0
    profile_steps: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.log_every, int) or self.log_every < 1:
            raise ConfigError(
                f"metrics.log_every={self.log_every!r}: metrics are gathered every N optimizer "
                "steps; N must be an integer >= 1."
            )
        every = self.system_every_s
        if every is not None and (isinstance(every, bool) or not isinstance(every, (int, float)) or not every >= 0.05):
            raise ConfigError(
                f"metrics.system_every_s={every!r}: give the seconds between system samples, at "
                "least 0.05 (1.0 is plenty for utilisation and network rates), or None to turn them off."
            )
        if self.profile_steps is not None:
            parse_profile_steps(str(self.profile_steps))


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
    run_dir: where metrics and TensorBoard events go; None means ./gradsync_runs/<timestamp>.
    checkpoint: when and where to save, and whether to resume (see `CheckpointConfig`).
    """

    accumulation_steps: int = 1
    precision: str = "fp32"
    max_grad_norm: float | None = None
    seed: int = 0
    device: str | None = None
    backend: str | None = None
    timeout_s: float | None = None
    run_dir: str | None = None
    ddp: DDPConfig = field(default_factory=DDPConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ddp", _section(DDPConfig, self.ddp, "ddp"))
        object.__setattr__(self, "metrics", _section(MetricsConfig, self.metrics, "metrics"))
        object.__setattr__(self, "checkpoint", _section(CheckpointConfig, self.checkpoint, "checkpoint"))
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
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ConfigError(
                f"timeout_s={self.timeout_s!r}: use a positive number of seconds, or None for "
                "the backend's default."
            )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "TrainerConfig":
        """Build a config from keyword arguments, naming any unknown option."""
        return _section(cls, kwargs, "gradsync.setup()")

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


def _section(cls: type, value: Any, where: str) -> Any:
    """Accept a dataclass instance or a mapping of its fields; name unknown keys clearly."""
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"{where} expects a {cls.__name__} or a dict of its fields, got {type(value).__name__}."
        )
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigError(
            f"{where}: unknown option(s) {', '.join(unknown)}; valid options are "
            f"{', '.join(sorted(known))}."
        )
    return cls(**value)
