"""The options of per-step metrics: where rows go, how often ranks gather them, what is sampled."""

from __future__ import annotations

from dataclasses import dataclass

from gradsync.errors import ConfigError
from gradsync.profiling.capture import parse_profile_steps


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
