"""Everything a run directory holds that the report shows, read once and checked at the edge."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradsync.errors import GradsyncError
from gradsync.run import files


@dataclass
class RunRecords:
    """A run directory's records. Each part is optional except that at least one must exist.

    `rows`: metrics.jsonl (one aggregated row per optimizer step, written by the trainer).
    `diagnosis`: diagnosis.json (written by `gradsync run`).
    `breakdowns`: rank -> the profiler's step-time breakdown (profile/rank{r}.breakdown.json).
    `benchmarks`: (name, report.json) of each `gradsync bench train` report found in the folder.
    `system`: rank -> readings over time that `gradsync run` logged (workers/attemptN/system-rank{r}.jsonl,
    the latest attempt), for scripts that do not use gradsync's trainer.
    """

    run_dir: Path
    rows: list[dict[str, Any]] = field(default_factory=list)
    diagnosis: dict[str, Any] | None = None
    breakdowns: dict[int, dict[str, Any]] = field(default_factory=dict)
    benchmarks: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    system: dict[int, list[dict[str, Any]]] = field(default_factory=dict)

    @property
    def intervals(self) -> list[dict[str, Any]]:
        """The rows that close a gather interval: they carry per-rank busy time and system metrics."""
        return [row for row in self.rows if "rank_busy_s" in row]


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except ValueError as error:
        raise GradsyncError(f"{path} is not valid JSON ({error}); was it cut short by a crash? Remove or fix it.") from error


def _read_rows(path: Path) -> list[dict[str, Any]]:
    rows = []
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError:
            # A run killed mid-write leaves a partial last line; anything earlier is damage.
            if number == len(lines):
                break
            raise GradsyncError(f"{path}, line {number}: not a JSON object; the metrics file is damaged.") from None
    return rows


def collect(run_dir: str | Path) -> RunRecords:
    """Read a run directory (a trainer's, `gradsync run`'s, a bench output folder, or one shared by all)."""
    directory = Path(run_dir)
    if not directory.is_dir():
        raise GradsyncError(f"{directory}: no such run directory. Give the folder a run wrote (e.g. gradsync_runs/<time>).")
    records = RunRecords(directory)
    if (directory / "metrics.jsonl").is_file():
        records.rows = _read_rows(directory / "metrics.jsonl")
    if (directory / "diagnosis.json").is_file():
        records.diagnosis = _read_json(directory / "diagnosis.json")
    for path in sorted((directory / "profile").glob("rank*.breakdown.json")):
        rank = path.name.removeprefix("rank").removesuffix(".breakdown.json")
        if rank.isdigit():
            records.breakdowns[int(rank)] = _read_json(path)
    attempt = files.latest_attempt(directory)
    if attempt is not None:
        for path in files.attempt_dir(directory, attempt).glob("system-rank*.jsonl"):
            rank = path.name.removeprefix("system-rank").removesuffix(".jsonl")
            if rank.isdigit():
                records.system[int(rank)] = _read_rows(path)
    for path in sorted(directory.rglob("report.json")):
        report = _read_json(path)
        if isinstance(report, dict) and "results" in report:  # a `gradsync bench train` report
            records.benchmarks.append((str(path.parent.relative_to(directory)) or ".", report))
    if not (records.rows or records.diagnosis or records.breakdowns or records.benchmarks or records.system):
        raise GradsyncError(
            f"{directory} holds nothing to report: no metrics.jsonl (gradsync trainer), diagnosis.json "
            "(gradsync run), profile/ (--profile-steps) or report.json (gradsync bench train)."
        )
    return records
