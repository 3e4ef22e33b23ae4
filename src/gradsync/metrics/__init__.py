"""Per-optimizer-step metrics: timing, cross-rank aggregation, and where they are written.

`timing` measures on the timeline where work runs (wall clock on CPU, CUDA events on GPU),
including gradient communication that backward did not hide; `recorder` gathers each rank's
steps every few steps and aggregates them; `sinks` writes the result as JSON lines,
TensorBoard events and a progress display on rank 0.
"""

from gradsync.metrics.recorder import MetricsRecorder, StepRecord
from gradsync.metrics.timing import Clock, CommTimer

__all__ = ["Clock", "CommTimer", "MetricsRecorder", "StepRecord"]
