"""Per-step records: measured on each rank, gathered every few steps, aggregated on every rank.

Gathering once every `log_every` steps (one small object all-gather) instead of every step
keeps metrics off the critical path; every rank gets the aggregated rows, so the summary is
the same everywhere and no rank waits on rank 0's file writes.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gradsync import extras
from gradsync.metrics.config import MetricsConfig
from gradsync.errors import GradsyncError
from gradsync.metrics.sinks import JsonlSink, ProgressDisplay, TensorBoardSink
from gradsync.metrics.system import SystemSampler
from gradsync.netif import backend_interface
from gradsync.metrics.timing import Clock, Mark, bus_factor
from gradsync.rundir import RunDir

# Keys gradsync writes into every row; user-logged values may not shadow them.
@dataclass
class StepRecord:
    """What one rank measured during one optimizer step. Timestamps stay marks until resolved."""

    step: int
    epoch: int
    start: Mark
    end: Mark | None = None
    samples: int = 0
    reductions: int = 0
    skipped: str | None = None  # "overflow", "nonfinite" or "empty" when no update was applied
    grad_norm: float | None = None
    lr: float | None = None
    exposed: list[tuple[Mark, Mark]] = field(default_factory=list)
    # Exposed seconds carried over from a measured step, for a step whose communication was not
    # measured itself (tensor parallelism meters one step in several: see gradsync.parallel.tp).
    exposed_estimate_s: float = 0.0
    comm_windows: list[tuple[Mark, Mark]] = field(default_factory=list)  # first bucket ready -> backward end
    comm: dict[str, float] = field(default_factory=dict)  # raw/sent bytes and encode/decode time of the step
    values: dict[str, list[Any]] = field(default_factory=dict)  # key -> [weighted sum, weight]

    def add_value(self, key: str, value: Any, weight: float) -> None:
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise GradsyncError(
                    f"trainer.log({key}=...) takes scalars; got a tensor of shape "
                    f"{tuple(value.shape)}. Log value.mean() or similar."
                )
            value = value.detach().float().reshape(())
        else:
            value = float(value)
        total = self.values.setdefault(key, [0.0, 0.0])
        total[0] = total[0] + value * weight
        total[1] += weight

    def exposed_seconds(self, clock: Clock) -> float:
        """The step's communication that training waited for, within the step's own span.

        Bounded by construction, so that its share of the step cannot leave [0, 1]: the waits are
        taken as offsets from the step's start, cut to the span the step time measures (a wait
        begun before the window opened counts from its start), and merged where they overlap (two
        meters may time the same wait); an estimate carried from another step fills at most the
        rest of the span."""
        span = clock.seconds(self.start, self.end) if self.end is not None else math.inf
        waits = sorted((max(0.0, clock.seconds(self.start, a)), min(span, clock.seconds(self.start, b)))
                       for a, b in self.exposed)
        measured, reached = 0.0, 0.0
        for begin, finish in waits:
            begin = max(begin, reached)
            if finish > begin:
                measured += finish - begin
                reached = finish
        return measured + min(self.exposed_estimate_s, max(0.0, span - measured))

    def resolve(self, clock: Clock) -> dict[str, Any]:
        """Plain numbers (JSON-ready); waits for the step's device work on CUDA."""
        assert self.end is not None, "a step record is resolved only after its step ended"
        return {
            "step": self.step,
            "epoch": self.epoch,
            "samples": self.samples,
            "step_time_s": clock.seconds(self.start, self.end),
            "exposed_comm_s": self.exposed_seconds(clock),
            "comm_window_s": sum(clock.seconds(a, b) for a, b in self.comm_windows),
            "comm": dict(self.comm),
            "reductions": self.reductions,
            "skipped": self.skipped,
            "grad_norm": self.grad_norm,
            "lr": self.lr,
            "values": {k: float(s) / w for k, (s, w) in self.values.items() if w > 0},
        }


class RestoredStep(StepRecord):
    """The step a checkpoint was taken at, brought back by a resume: already timed, still open to
    `trainer.log()` (an end-of-epoch evaluation logs onto it after the resumed epoch's last step)."""

    def __init__(self, row: dict[str, Any], values: dict[str, list[float]]) -> None:
        super().__init__(step=row["step"], epoch=row["epoch"], start=None)
        self.row = row
        self.values = {key: list(total) for key, total in values.items()}

    def resolve(self, clock: Clock) -> dict[str, Any]:
        return {**self.row, "values": {k: float(s) / w for k, (s, w) in self.values.items() if w > 0}}


def aggregate(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One row for one optimizer step from every rank's record of it.

    The gradient all-reduce synchronises ranks every step, so their wall-clock step times come
    out nearly equal: a fast rank spends the difference waiting inside the reduction. The
    slowest rank is therefore the one *busiest* outside communication (step time minus
    exposed communication); the others wait for it.
    """
    first = per_rank[0]
    times = [r["step_time_s"] for r in per_rank]
    busy = [r["step_time_s"] - r["exposed_comm_s"] for r in per_rank]
    slowest = max(range(len(busy)), key=busy.__getitem__)
    samples = sum(r["samples"] for r in per_rank)
    mean_time = statistics.fmean(times)
    mean_exposed = statistics.fmean(r["exposed_comm_s"] for r in per_rank)
    row: dict[str, Any] = {"step": first["step"], "epoch": first["epoch"]}
    for key in sorted({k for r in per_rank for k in r["values"]}):
        row[key] = statistics.fmean(r["values"][key] for r in per_rank if key in r["values"])
    row.update(
        samples=samples,
        samples_per_s=samples / max(times) if max(times) > 0 else 0.0,
        step_time_s=mean_time,
        step_time_max_s=max(times),
        slowest_rank=slowest,
        slowest_rank_busy_s=busy[slowest],
        exposed_comm_s=mean_exposed,
        exposed_comm_share=mean_exposed / mean_time if mean_time > 0 else 0.0,
        reductions=first["reductions"],
        skipped=first["skipped"],
        grad_norm=first["grad_norm"],
        lr=first["lr"],
    )
    row.update(_communication(per_rank))
    return row


def _communication(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Bytes sent, compression ratio, bus bandwidth and codec time of one step's gradient reduction.

    Bus bandwidth follows nccl-tests for all-reduce: bytes / time * 2(n-1)/n. The time is the
    window from the first ready bucket to the end of backward, which may include overlapped
    compute, so the figure is a lower bound on what the network delivered.
    """
    comm = per_rank[0].get("comm") or {}
    raw, sent = comm.get("raw_bytes", 0), comm.get("sent_bytes", 0)
    if not raw:
        return {}
    n = len(per_rank)
    window = statistics.fmean(r.get("comm_window_s", 0.0) for r in per_rank)
    values: dict[str, Any] = {
        "comm_bytes": sent,
        "compression_ratio": raw / sent if sent else 1.0,
        "busbw_gbps": sent / window * bus_factor(n) / 1e9 if window > 0 and n > 1 else 0.0,
    }
    if "encode_s" in comm:
        values["encode_s"] = statistics.fmean(r["comm"].get("encode_s", 0.0) for r in per_rank)
        values["decode_s"] = statistics.fmean(r["comm"].get("decode_s", 0.0) for r in per_rank)
    # FSDP and tensor parallelism move more than gradients: each kind's bytes (nccl-tests sizes).
    for kind in ("all_gather_bytes", "reduce_scatter_bytes", "all_reduce_bytes", "p2p_bytes"):
        if kind in comm:
            values[kind] = comm[kind]
    if "pipeline_schedule_s" in comm:
        # A pipeline's bubble, measured: the share of the schedule's time each rank's stages sat
        # waiting inside it (for neighbours' activations or gradients), averaged over ranks. Over
        # one span for both, by construction in [0, 1]: the stages' compute is timed inside the
        # schedule's run, on the same clock, so it never exceeds it.
        shares = [1.0 - r["comm"]["pipeline_compute_s"] / r["comm"]["pipeline_schedule_s"]
                  for r in per_rank if r["comm"].get("pipeline_schedule_s", 0.0) > 0]
        values["pipeline_bubble_share"] = statistics.fmean(shares) if shares else 0.0
    return values


def interval_summary(per_rank: list[tuple[list[dict[str, Any]], dict[str, float]]]) -> dict[str, Any]:
    """What the ranks did over one gather interval, side by side: the imbalance signals.

    Per rank: its mean busy time per step (step time minus exposed communication: what a rank
    spends outside waiting for the others) and its system metrics. Across ranks: the spread of
    busy time and of GPU utilisation, and the rank busiest on average, i.e. the one the others
    wait for.
    """
    busy = [
        statistics.fmean(r["step_time_s"] - r["exposed_comm_s"] for r in records) if records else 0.0
        for records, _ in per_rank
    ]
    summary: dict[str, Any] = {
        "rank_busy_s": {str(rank): value for rank, value in enumerate(busy)},
        "busy_spread_s": max(busy) - min(busy),
        "interval_slowest_rank": max(range(len(busy)), key=busy.__getitem__),
    }
    systems = {str(rank): system for rank, (_, system) in enumerate(per_rank) if system}
    if systems:
        summary["system"] = systems
        utilisation = [s["gpu_util_percent"] for s in systems.values() if "gpu_util_percent" in s]
        if utilisation:
            summary["gpu_util_spread"] = max(utilisation) - min(utilisation)
    return summary


class MetricsRecorder:
    """Collects this rank's step records and turns them into rows, totals and a summary."""

    def __init__(
        self,
        config: MetricsConfig,
        clock: Clock,
        *,
        rank: int,
        world_size: int,
        distributed: bool,
        control_group: Any,
        run_dir: Path,
        logger: Any,
        gpu_uuid: str | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.world_size = world_size
        self._distributed = distributed and world_size > 1
        self._group = control_group
        self._buffer: list[dict[str, Any]] = []
        self._sinks: list[Any] = []
        if rank == 0:
            if config.jsonl:
                self._sinks.append(JsonlSink(RunDir(run_dir).metrics))
            if config.tensorboard:
                try:
                    self._sinks.append(TensorBoardSink(RunDir(run_dir).tensorboard))
                except extras.MissingExtra as missing:
                    # metrics.tensorboard is on by default and TensorBoard is only another view of
                    # the same rows: a run that may have waited hours for its machines goes on.
                    kept = ", every row still goes to metrics.jsonl" if config.jsonl else ""
                    logger.warning(f"{missing} (or set metrics.tensorboard=False); training goes on without it{kept}")
        self.progress = ProgressDisplay(logger, enabled=rank == 0 and config.progress)
        self._system: SystemSampler | None = None
        if config.system_every_s is not None:
            self._system = SystemSampler(config.system_every_s, backend_interface(), gpu_uuid).start()
            if rank == 0 and gpu_uuid is not None:
                # Said once, by rank 0, like the other summaries: the ranks share one environment as a rule.
                no_nvml = extras.missing("pynvml", "GPU utilisation, memory, temperature, power and clocks are read")
                if no_nvml is not None:
                    logger.warning(f"{no_nvml}; the system metrics go on without them")
        self.last_row: dict[str, Any] | None = None
        self._steps = 0
        self._skips: dict[str, int] = {}
        self._samples = 0
        self._time = 0.0
        self._step_time_sum = 0.0
        self._exposed_sum = 0.0

    def add(self, record: StepRecord) -> None:
        resolved = record.resolve(self.clock)
        self._buffer.append(resolved)
        self.progress.advance(resolved)
        if len(self._buffer) >= self.config.log_every:
            self.flush()

    def flush(self) -> None:
        """Gather buffered steps from every rank and write them. Collective: all ranks call it."""
        system = self._system.take() if self._system is not None else {}
        if self._distributed:
            per_rank: list[Any] = [None] * self.world_size
            dist.all_gather_object(per_rank, (self._buffer, system), group=self._group)
        else:
            per_rank = [(self._buffer, system)]
        self._buffer = []
        lengths = [len(records) for records, _ in per_rank]
        if len(set(lengths)) > 1:
            raise GradsyncError(
                "ranks recorded different numbers of optimizer steps since the last gather "
                f"({', '.join(f'rank {r}: {n}' for r, n in enumerate(lengths))}): their training "
                "loops diverged. Make skip/stop decisions with trainer.agree_any() so every rank "
                "takes them together."
            )
        rows = [aggregate(list(records)) for records in zip(*(records for records, _ in per_rank))]
        if rows:
            rows[-1].update(interval_summary(per_rank))
        for row in rows:
            self._count(row)
            for sink in self._sinks:
                sink.write(row)
            self.last_row = row
        if self.last_row is not None and lengths[0]:
            self.progress.report(self.last_row)

    def _count(self, row: dict[str, Any]) -> None:
        self._steps += 1
        if row["skipped"]:
            self._skips[row["skipped"]] = self._skips.get(row["skipped"], 0) + 1
        self._samples += row["samples"]
        self._time += row["step_time_max_s"]
        self._step_time_sum += row["step_time_s"]
        self._exposed_sum += row["exposed_comm_s"]

    def summary(self) -> dict[str, Any]:
        """Totals over every step gathered so far (identical on every rank)."""
        return {
            "world_size": self.world_size,
            "steps": self._steps,
            "skipped_steps": sum(self._skips.values()),
            "skip_reasons": dict(self._skips),
            "samples": self._samples,
            "samples_per_s": self._samples / self._time if self._time > 0 else 0.0,
            "mean_step_time_s": self._step_time_sum / self._steps if self._steps else 0.0,
            "exposed_comm_share": self._exposed_sum / self._step_time_sum if self._step_time_sum > 0 else 0.0,
            "loss": None if self.last_row is None else self.last_row.get("loss"),
        }

    _COUNTERS = ("_steps", "_skips", "_samples", "_time", "_step_time_sum", "_exposed_sum")

    def state_dict(self, pending: StepRecord | None = None) -> dict[str, Any]:
        """Totals (equal on every rank), this rank's rows not gathered yet, and `pending`, the
        step still open to `trainer.log()`, so a resumed run reports every step exactly once."""
        return {
            "totals": {name: getattr(self, name) for name in self._COUNTERS},
            "rows": list(self._buffer),
            "pending": None if pending is None else {
                "row": pending.resolve(self.clock),
                "values": {key: [float(s), float(w)] for key, (s, w) in pending.values.items()},
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> RestoredStep | None:
        """Continue from `state_dict`; returns the pending step to keep open for `trainer.log()`."""
        for name in self._COUNTERS:
            setattr(self, name, state["totals"][name])
        self._buffer = list(state["rows"])
        pending = state["pending"]
        return None if pending is None else RestoredStep(pending["row"], pending["values"])

    def close(self) -> None:
        if self._system is not None:
            self._system.stop()
            self._system = None
        self.progress.close()
        for sink in self._sinks:
            sink.close()
        self._sinks = []
