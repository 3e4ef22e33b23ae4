"""Where rank 0 writes aggregated rows: JSON lines, TensorBoard, and the terminal."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from gradsync.extras import require

# TensorBoard tags of gradsync's own columns; a user key goes under train/ unless it names its
# own section ("eval/accuracy").
_TAGS = {
    "samples_per_s": "train/samples_per_s",
    "step_time_s": "train/step_time_s",
    "step_time_max_s": "train/step_time_max_s",
    "slowest_rank_busy_s": "train/slowest_rank_busy_s",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "exposed_comm_s": "comm/exposed_s",
    "exposed_comm_share": "comm/exposed_share",
    "reductions": "comm/reductions",
    "comm_bytes": "comm/bytes",
    "compression_ratio": "comm/compression_ratio",
    "busbw_gbps": "comm/busbw_gbps",
    "encode_s": "comm/encode_s",
    "decode_s": "comm/decode_s",
    "p2p_bytes": "comm/p2p_bytes",
    "pipeline_bubble_share": "comm/pipeline_bubble_share",
    "busy_spread_s": "system/busy_spread_s",
    "interval_slowest_rank": "system/slowest_rank",
    "gpu_util_spread": "system/gpu_util_spread",
}
_NOT_PLOTTED = frozenset({"step", "epoch", "samples", "slowest_rank", "skipped", "system", "rank_busy_s"})


def tensorboard_tag(key: str) -> str:
    return _TAGS.get(key) or (key if "/" in key else f"train/{key}")


class JsonlSink:
    """One JSON object per optimizer step, appended and flushed as it comes."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("a", encoding="utf-8")

    def write(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """Scalars per step under train/, comm/ and system/ (each rank's machine under
    system/rank{r}/), readable by `tensorboard --logdir RUN_DIR`."""

    def __init__(self, log_dir: Path) -> None:
        """MissingExtra (naming `gradsync[tensorboard]`) when the tensorboard package is not installed."""
        require("tensorboard", "metrics.tensorboard writes TensorBoard scalars")
        from torch.utils.tensorboard import SummaryWriter  # imported late: slow, rank 0 only

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, row: dict[str, Any]) -> None:
        step = row["step"]
        for key, value in row.items():
            if key in _NOT_PLOTTED or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            if math.isfinite(value):
                self.writer.add_scalar(tensorboard_tag(key), value, step)
        self.writer.add_scalar("train/skipped", float(row["skipped"] is not None), step)
        for rank, values in row.get("system", {}).items():
            for key, value in values.items():
                self.writer.add_scalar(f"system/rank{rank}/{key}", value, step)
        for rank, value in row.get("rank_busy_s", {}).items():
            self.writer.add_scalar(f"system/rank{rank}/busy_s", value, step)

    def close(self) -> None:
        self.writer.close()


def format_row(row: dict[str, Any], total_steps: int | None) -> str:
    of_total = f"/{total_steps}" if total_steps else ""
    parts = [f"step {row['step']}{of_total}", f"epoch {row['epoch']}"]
    if "loss" in row:
        parts.append(f"loss {row['loss']:.4f}")
    parts.append(f"{row['samples_per_s']:.0f} samples/s")
    parts.append(f"exposed comm {100 * row['exposed_comm_share']:.0f}%")
    if "pipeline_bubble_share" in row:
        parts.append(f"bubble {100 * row['pipeline_bubble_share']:.0f}%")
    if row["skipped"]:
        parts.append(f"skipped ({row['skipped']})")
    return " | ".join(parts)


class ProgressDisplay:
    """Rank 0's view of training: a live bar in a terminal, a log line per gather otherwise."""

    def __init__(self, logger: Any, enabled: bool) -> None:
        self.logger = logger
        self.enabled = enabled
        self.total_steps: int | None = None
        console = Console(stderr=True)
        self._bar: Progress | None = None
        if enabled and console.is_terminal:
            self._bar = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=console,
            )
            self._task = self._bar.add_task("train", total=None, status="")
            self._bar.start()

    def set_total(self, total_steps: int) -> None:
        self.total_steps = total_steps
        if self._bar is not None:
            self._bar.update(self._task, total=total_steps)

    def advance(self, local: dict[str, Any]) -> None:
        """One step done; shows this rank's own loss so the bar never waits on a gather."""
        if self._bar is None:
            return
        loss = local["values"].get("loss")
        status = "" if loss is None else f"loss {loss:.4f}"
        self._bar.update(self._task, advance=1, status=status)

    def report(self, row: dict[str, Any]) -> None:
        if self.enabled and self._bar is None:
            self.logger.info(format_row(row, self.total_steps))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
