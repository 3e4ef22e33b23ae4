"""Writing and reading a run folder's files: atomic writers, readers that never fail on damage.

A reader of a run folder reads what processes left while they were being killed: a snapshot
written as the process died, a JSON-lines file cut off mid-line. Writers replace whole files
atomically (temporary file, then rename); readers skip what is damaged and say what they
skipped, and are never fatal. The ring of collectives is a memory-mapped file of fixed slots,
so a worker killed by SIGKILL or aborted inside Gloo still leaves its last collectives behind
(the page cache outlives the process), at the cost of a memcpy per record.
"""

from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradsync.rundir.layout import EXIT_RECORD, FLIGHT, SNAPSHOT, RunDir
from gradsync.rundir.records import RECORD_FIELDS


def write_json(path: Path, data: Any) -> None:
    """Atomically replace `path` with `data` as JSON."""
    write_bytes(path, json.dumps(data, default=str).encode())


def write_bytes(path: Path, data: bytes) -> None:
    """Atomically replace `path` with `data` (its folder made if missing): a reader never sees
    half a file, even from a writer killed mid-write."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)


def read_json(path: Path) -> Any | None:
    """The file's JSON value; None when it is missing, unreadable or damaged."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _line_numbers(numbers: list[int]) -> str:
    shown = ", ".join(map(str, numbers[:5]))
    if len(numbers) == 1:
        return f"line {shown}"
    return f"lines {shown}" + (f" ({len(numbers)} in all)" if len(numbers) > 5 else "")


@dataclass
class TolerantReader:
    """Reads the files under `root`, noting in `skipped` (one line each: which file or lines,
    and why) what it has to leave out, for a reader that shows what is missing."""

    root: Path
    skipped: list[str] = field(default_factory=list)

    def skip(self, path: Path, why: str, lines: list[int] | None = None) -> None:
        try:
            where = str(path.relative_to(self.root))
        except ValueError:
            where = str(path)
        self.skipped.append(where + (f" {_line_numbers(lines)}" if lines else "") + f": {why}")

    def text(self, path: Path) -> str | None:
        try:
            return path.read_text(errors="replace")  # binary garbage fails as JSON, line by line
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


# -- the ring of collectives --------------------------------------------------------------------

RING_SLOT_BYTES = 512
_FIXED_FIELDS = RECORD_FIELDS[:8]  # known when a collective is entered; the rest change as it runs


def _json_number(value: float | int | None) -> str:
    return "null" if value is None else repr(value)


class RingWriter:
    """The last `slots` collectives of one worker, one JSON array per fixed-size slot.

    Written on the training thread at every change of a record (entered, finished), so the
    encoding is split: the fixed fields are encoded once per record and kept on it
    (`record.ring_prefix`), a change re-encodes only the few that moved.
    """

    def __init__(self, path: Path, slots: int):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.slots = slots
        with open(path, "w+b") as handle:
            handle.truncate(slots * RING_SLOT_BYTES)
            self.memory = mmap.mmap(handle.fileno(), slots * RING_SLOT_BYTES)

    def write(self, record: Any) -> None:
        prefix = record.ring_prefix
        if prefix is None:
            fixed = [getattr(record, name) for name in _FIXED_FIELDS]
            prefix = json.dumps(fixed)[:-1].encode()
            if len(prefix) > RING_SLOT_BYTES - 128:  # an enormous signature: keep what identifies the record
                fixed[4], fixed[7] = fixed[4][:200], None
                prefix = json.dumps(fixed)[:-1].encode()[: RING_SLOT_BYTES - 128]
            record.ring_prefix = prefix
        error = "null" if record.error is None else json.dumps(record.error[:100])
        changing = f',"{record.state}",{record.entered!r},{_json_number(record.finished)},{_json_number(record.crc)},{error}]'
        data = prefix + changing.encode()
        start = (record.index % self.slots) * RING_SLOT_BYTES
        self.memory[start : start + RING_SLOT_BYTES] = data[: RING_SLOT_BYTES - 1].ljust(RING_SLOT_BYTES, b"\0")


def read_ring(path: Path) -> list[dict[str, Any]]:
    """The records left in a ring file, oldest first (a slot being rewritten at death is skipped)."""
    try:
        raw = path.read_bytes()
    except OSError:
        return []
    records = []
    for start in range(0, len(raw), RING_SLOT_BYTES):
        slot = raw[start : start + RING_SLOT_BYTES].rstrip(b"\0")
        if slot:
            try:
                records.append(dict(zip(RECORD_FIELDS, json.loads(slot))))
            except ValueError:
                continue
    return sorted(records, key=lambda r: r["index"])


# -- what the workers of one attempt left -------------------------------------------------------


def read_by_rank(run: RunDir, attempt: int, pattern: str) -> dict[int, Any]:
    """rank -> JSON value of the attempt's files named like `pattern` (layout.FAULT, ...); damaged ones left out."""
    found = {}
    for rank, path in run.ranks_with(attempt, pattern).items():
        data = read_json(path)
        if data is not None:
            found[rank] = data
    return found


def read_attempt(run: RunDir, attempt: int) -> tuple[dict[int, dict], dict[int, dict]]:
    """Every rank's latest snapshot and exit record of one attempt, keyed by global rank.

    Each gets the rank's recorded collectives from its ring file under "records", and their
    count under "collectives"; and its latest Flight Recorder dump, if it left one, under "flight".
    """
    exits = read_by_rank(run, attempt, EXIT_RECORD)
    snapshots = read_by_rank(run, attempt, SNAPSHOT)
    flights = read_by_rank(run, attempt, FLIGHT)
    for rank, data in (*snapshots.items(), *exits.items()):
        data["records"] = read_ring(run.ring(attempt, rank))
        data["collectives"] = data["records"][-1]["index"] + 1 if data["records"] else 0
        if rank in flights:
            data["flight"] = flights[rank]
    return snapshots, exits
