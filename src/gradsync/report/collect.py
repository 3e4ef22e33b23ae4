"""Everything a run directory holds that the report shows, read once and checked at the edge."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradsync.errors import GradsyncError
from gradsync.report import timeline
from gradsync.rundir import RunDir, TolerantReader, layout, read_attempt
from gradsync.rundir.records import METRICS_REQUIRED


@dataclass
class RunRecords:
    """A run directory's records. Each part is optional except that at least one must exist.

    `rows`: metrics.jsonl (one aggregated row per optimizer step, written by the trainer).
    `diagnosis`: diagnosis.json (written by `gradsync run`).
    `breakdowns`: rank -> the profiler's step-time breakdown (profile/rank{r}.breakdown.json).
    `benchmarks`: (name, report.json) of each `gradsync bench train` report found in the folder.
    `system`: rank -> readings over time that `gradsync run` logged (workers/attemptN/system-rank{r}.jsonl,
    the latest attempt), for scripts that do not use gradsync's trainer.
    `description`: run.json (the trainer's configuration and wall time), None without it.
    `workers`: rank -> the latest attempt's last state of each worker (its exit record, else its
    last snapshot), with its recorded collectives under "records": who it was, where it ended.
    `skipped`: what was damaged and left out (which file or lines, and why), one line each: a crash can cut any file
    short, and the rest of the run is still worth a report that says what is missing.
    """

    run_dir: Path
    rows: list[dict[str, Any]] = field(default_factory=list)
    diagnosis: dict[str, Any] | None = None
    breakdowns: dict[int, dict[str, Any]] = field(default_factory=dict)
    benchmarks: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    system: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    description: dict[str, Any] | None = None
    workers: dict[int, dict[str, Any]] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)

    @property
    def intervals(self) -> list[dict[str, Any]]:
        """The rows that close a gather interval: they carry per-rank busy time and system metrics."""
        return [row for row in self.rows if "rank_busy_s" in row]

    @property
    def failed(self) -> bool:
        """gradsync run judged the run failed or stopped: what went wrong leads the page."""
        return (self.diagnosis or {}).get("status") not in (None, "ok")

    @property
    def collectives(self) -> dict[int, list[dict[str, Any]]]:
        """rank -> the latest attempt's recorded collectives, oldest first (ranks that recorded none left out)."""
        return {rank: state["records"] for rank, state in self.workers.items() if state.get("records")}

    @functools.cached_property
    def last_seen(self) -> float:
        """The latest moment any worker was seen: its last snapshot, or a collective entered or completed."""
        moments = [state.get("time") or 0.0 for state in self.workers.values()]
        moments += [r.get("finished") or r["entered"] for records in self.collectives.values() for r in records]
        return max(moments, default=0.0)

    @functools.cached_property
    def recorded(self) -> timeline.Timeline | None:
        """gradsync run's per-rank step times and waits, for a run whose loop is not gradsync's
        trainer (the trainer measures the same inside each step, so its runs use its rows)."""
        if self.rows:
            return None
        return timeline.timeline({rank: rows for rank, rows in self.system.items() if rows})


# Every machine reading carries its time; a line without it is damage.
SYSTEM_KEYS = ("time",)


def _json_object(reader: TolerantReader, path: Path) -> dict[str, Any] | None:
    """The file's JSON object; None when there is no such file, or (noted) when it holds none."""
    if not path.is_file():
        return None
    value = reader.json_value(path)
    if value is not None and not isinstance(value, dict):
        reader.skip(path, "not a JSON object")
    return value if isinstance(value, dict) else None


def collect(run_dir: str | Path) -> RunRecords:
    """Read a run directory (a trainer's, `gradsync run`'s, a bench output folder, or one shared by all)."""
    directory = Path(run_dir)
    if not directory.exists():
        raise GradsyncError(f"{directory}: no such run directory. Give the folder a run wrote (e.g. gradsync_runs/<time>).")
    if not directory.is_dir():
        raise GradsyncError(f"{directory} is a file, not a run directory. Give the folder a run wrote (e.g. gradsync_runs/<time>).")
    records = RunRecords(directory)
    run = RunDir(directory)
    reader = TolerantReader(directory, records.skipped)
    if run.metrics.is_file():
        records.rows = reader.rows(run.metrics, METRICS_REQUIRED)
    records.diagnosis = _json_object(reader, run.diagnosis)
    for rank, path in run.profile_breakdowns().items():
        breakdown = reader.json_value(path)
        if isinstance(breakdown, dict) and isinstance(breakdown.get("mean"), dict):
            records.breakdowns[rank] = breakdown
        elif breakdown is not None:
            reader.skip(path, "no 'mean' breakdown in it")
    records.description = _json_object(reader, run.description)
    attempt = run.latest_attempt()
    if attempt is not None:
        for rank, path in run.ranks_with(attempt, layout.SYSTEM).items():
            records.system[rank] = reader.rows(path, SYSTEM_KEYS)
        snapshots, exits = read_attempt(run, attempt)
        records.workers = dict(sorted({**snapshots, **exits}.items()))
    for path in sorted(directory.rglob("report.json")):
        report = reader.json_value(path)
        if isinstance(report, dict) and "results" in report:  # a `gradsync bench train` report
            records.benchmarks.append((str(path.parent.relative_to(directory)) or ".", report))
    if not (records.rows or records.diagnosis or records.breakdowns or records.benchmarks or any(records.system.values())):
        if records.skipped:
            raise GradsyncError(f"{directory}: nothing in it could be read ({'; '.join(records.skipped)})")
        raise GradsyncError(
            f"{directory} holds nothing to report: no metrics.jsonl (gradsync trainer), diagnosis.json "
            "(gradsync run), profile/ (--profile-steps) or report.json (gradsync bench train)."
        )
    return records
