"""Run directories: one folder per run for its metrics, TensorBoard events and reports."""

from __future__ import annotations

import time
from pathlib import Path

RUNS_ROOT = Path("gradsync_runs")


def fresh_run_dir(prefix: str = "") -> Path:
    """A run directory name not used yet: gradsync_runs/<prefix><timestamp>[-N]."""
    base = RUNS_ROOT / f"{prefix}{time.strftime('%Y%m%d-%H%M%S')}"
    candidate, n = base, 1
    while candidate.exists():
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate
