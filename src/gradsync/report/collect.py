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
    `skipped`: what was damaged and left out (which file or lines, and why), one line each: a crash can cut any file
    short, and the rest of the run is still worth a report that says what is missing.
    """

    run_dir: Path
    rows: list[dict[str, Any]] = field(default_factory=list)
    diagnosis: dict[str, Any] | None = None
    breakdowns: dict[int, dict[str, Any]] = field(default_factory=dict)
    benchmarks: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    system: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)

    @property
    def intervals(self) -> list[dict[str, Any]]:
        """The rows that close a gather interval: they carry per-rank busy time and system metrics."""
        return [row for row in self.rows if "rank_busy_s" in row]


# The numbers the report draws from each kind of row: a line without them is damage, not a reading.
METRICS_KEYS = ("step", "samples_per_s", "step_time_s", "exposed_comm_s")
SYSTEM_KEYS = ("time",)


def _line_numbers(numbers: list[int]) -> str:
    shown = ", ".join(map(str, numbers[:5]))
    if len(numbers) == 1:
        return f"line {shown}"
    return f"lines {shown}" + (f" ({len(numbers)} in all)" if len(numbers) > 5 else "")


@dataclass
class _Reader:
    """Reads the files of one run directory, noting in `skipped` what it has to leave out."""

    directory: Path
    skipped: list[str]

    def skip(self, path: Path, why: str, lines: list[int] | None = None) -> None:
        where = str(path.relative_to(self.directory)) + (f" {_line_numbers(lines)}" if lines else "")
        self.skipped.append(f"{where}: {why}")

    def text(self, path: Path) -> str | None:
        try:
            return path.read_text(errors="replace")  # binary garbage fails as JSON below, line by line
        except OSError as error:
            self.skip(path, f"cannot be read ({error.strerror})")
            return None

    def json_value(self, path: Path) -> Any:
        """The file's JSON value, or None (noted) when it cannot be read or parsed."""
        text = self.text(path)
        if text is None:
            return None
        try:
            return json.loads(text)
        except ValueError:
            self.skip(path, "not valid JSON (cut off by a crash?)")
            return None

    def rows(self, path: Path, keys: tuple[str, ...]) -> list[dict[str, Any]]:
        """The JSON-lines file's rows that carry every one of `keys` as a number; the rest noted."""
        text = self.text(path)
        if text is None:
            return []
        rows, not_json, incomplete = [], [], []
        lines = text.splitlines()
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                not_json.append(number)
                continue
            if isinstance(row, dict) and all(isinstance(row.get(key), (int, float)) for key in keys):
                rows.append(row)
            else:
                incomplete.append(number)
        # A run killed mid-write leaves a partial last line; anything earlier is damage.
        damaged = [number for number in not_json if number != len(lines)]
        if damaged:
            self.skip(path, "not valid JSON (damaged)", damaged)
        if len(lines) in not_json:
            self.skip(path, "not valid JSON (cut off by a crash?)", [len(lines)])
        if incomplete:
            self.skip(path, f"not a JSON object with numbers for {', '.join(keys)}", incomplete)
        return rows


def collect(run_dir: str | Path) -> RunRecords:
    """Read a run directory (a trainer's, `gradsync run`'s, a bench output folder, or one shared by all)."""
    directory = Path(run_dir)
    if not directory.exists():
        raise GradsyncError(f"{directory}: no such run directory. Give the folder a run wrote (e.g. gradsync_runs/<time>).")
    if not directory.is_dir():
        raise GradsyncError(f"{directory} is a file, not a run directory. Give the folder a run wrote (e.g. gradsync_runs/<time>).")
    records = RunRecords(directory)
    reader = _Reader(directory, records.skipped)
    if (directory / "metrics.jsonl").is_file():
        records.rows = reader.rows(directory / "metrics.jsonl", METRICS_KEYS)
    if (directory / "diagnosis.json").is_file():
        diagnosis = reader.json_value(directory / "diagnosis.json")
        if isinstance(diagnosis, dict):
            records.diagnosis = diagnosis
        elif diagnosis is not None:
            reader.skip(directory / "diagnosis.json", "not a JSON object")
    for path in sorted((directory / "profile").glob("rank*.breakdown.json")):
        rank = path.name.removeprefix("rank").removesuffix(".breakdown.json")
        if rank.isdigit():
            breakdown = reader.json_value(path)
            if isinstance(breakdown, dict) and isinstance(breakdown.get("mean"), dict):
                records.breakdowns[int(rank)] = breakdown
            elif breakdown is not None:
                reader.skip(path, "no 'mean' breakdown in it")
    attempt = files.latest_attempt(directory)
    if attempt is not None:
        for path in sorted(files.attempt_dir(directory, attempt).glob("system-rank*.jsonl")):
            rank = path.name.removeprefix("system-rank").removesuffix(".jsonl")
            if rank.isdigit():
                records.system[int(rank)] = reader.rows(path, SYSTEM_KEYS)
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
