"""Where the workers and the launcher of `gradsync run` meet: files in the run directory.

The process group may be the thing that is stuck, so state never travels through it. Each
worker rewrites a small JSON snapshot of its recorder every second (write to a temporary file,
then rename, so a reader never sees half a file) and leaves an exit record when its script ends.
Its collectives go, as they happen, into a fixed-size ring of slots in a memory-mapped file: a
worker killed by SIGKILL or aborted inside Gloo still leaves its last collectives behind (the
page cache outlives the process), at the cost of a memcpy per record.
Files are grouped by restart attempt (workers/attemptN/: snapshots, rings, exit records, the
records of injected faults that fired, the script-check facts of --doctor-steps, and that
attempt's diagnosis), so a restarted group never
mixes with the one it replaces and every failed attempt keeps its own diagnosis.
"""

from __future__ import annotations

import json
import mmap
import os
import time
from pathlib import Path
from typing import Any

DIAGNOSIS_FILE = "diagnosis.json"
OPTIONS_FILE = "run_options.json"


def attempt_dir(run_dir: Path, attempt: int) -> Path:
    return run_dir / "workers" / f"attempt{attempt}"


def snapshot_path(run_dir: Path, attempt: int, rank: int) -> Path:
    return attempt_dir(run_dir, attempt) / f"rank{rank}.json"


def ring_path(run_dir: Path, attempt: int, rank: int) -> Path:
    return attempt_dir(run_dir, attempt) / f"rank{rank}.ring"


def exit_path(run_dir: Path, attempt: int, rank: int) -> Path:
    return attempt_dir(run_dir, attempt) / f"rank{rank}.exit.json"


def launcher_log_path(run_dir: Path) -> Path:
    """What torchrun's agent logged about starting, stopping and restarting the workers."""
    return run_dir / "launcher.log"


def log_path(run_dir: Path, attempt: int, rank: int) -> Path:
    """Everything the rank printed, its backend libraries' log lines and its traceback (gradsync.run.output)."""
    return attempt_dir(run_dir, attempt) / f"rank{rank}.log"


def system_path(run_dir: Path, attempt: int, rank: int) -> Path:
    """One JSON line per snapshot: the rank's system metrics (gradsync.metrics.system) over time."""
    return attempt_dir(run_dir, attempt) / f"system-rank{rank}.jsonl"


def fault_path(run_dir: Path, attempt: int, rank: int) -> Path:
    """The record an injected fault leaves just before it fires (see gradsync.run.faults)."""
    return attempt_dir(run_dir, attempt) / f"fault-rank{rank}.json"


def script_check_path(run_dir: Path, attempt: int, rank: int) -> Path:
    """What a rank saw of its own run under --doctor-steps (see gradsync.run.script_check)."""
    return attempt_dir(run_dir, attempt) / f"script-check-rank{rank}.json"


def attempt_diagnosis_path(run_dir: Path, attempt: int) -> Path:
    """Each attempt's own diagnosis; RUN_DIR/diagnosis.json is the latest one (the final attempt's at the end)."""
    return attempt_dir(run_dir, attempt) / DIAGNOSIS_FILE


def write_json(path: Path, data: Any) -> None:
    """Atomically replace `path` with `data` as JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(data, default=str))
    os.replace(temporary, path)


def read_json(path: Path) -> Any | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def archive_previous_launch(run_dir: Path) -> Path | None:
    """Move an earlier launch's worker files, diagnosis and launcher log out of the way (into
    RUN_DIR/previous/<time>/), so a relaunch in the same run directory, such as a resumed job,
    is never diagnosed from the old launch's records. Returns where they went."""
    records = [path for path in (run_dir / "workers", run_dir / DIAGNOSIS_FILE, launcher_log_path(run_dir)) if path.exists()]
    if not records:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(records[0].stat().st_mtime))
    archive = run_dir / "previous" / stamp
    n = 1
    while archive.exists():
        n += 1
        archive = archive.with_name(f"{stamp}-{n}")
    archive.mkdir(parents=True)
    for path in records:
        path.rename(archive / path.name)
    return archive


def latest_attempt(run_dir: Path) -> int | None:
    attempts = [int(p.name.removeprefix("attempt")) for p in (run_dir / "workers").glob("attempt*") if p.name[7:].isdigit()]
    return max(attempts) if attempts else None


RING_SLOT_BYTES = 512
RECORD_FIELDS = ("index", "group", "seq", "op", "signature", "kind", "site", "state", "entered", "finished", "crc", "error")
_FIXED_FIELDS = RECORD_FIELDS[:7]  # known when a collective is entered; the rest change as it runs


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

    def write(self, record) -> None:
        prefix = record.ring_prefix
        if prefix is None:
            fixed = [getattr(record, name) for name in _FIXED_FIELDS]
            prefix = json.dumps(fixed)[:-1].encode()
            if len(prefix) > RING_SLOT_BYTES - 128:  # an enormous signature: keep what identifies the record
                fixed[4] = fixed[4][:200]
                prefix = json.dumps(fixed)[:-1].encode()[: RING_SLOT_BYTES - 128]
            record.ring_prefix = prefix
        error = "null" if record.error is None else json.dumps(record.error[:100])
        changing = f',"{record.state}",{record.entered!r},{_json_number(record.finished)},{_json_number(record.crc)},{error}]'
        data = prefix + changing.encode()
        start = (record.index % self.slots) * RING_SLOT_BYTES
        self.memory[start : start + RING_SLOT_BYTES] = data[: RING_SLOT_BYTES - 1].ljust(RING_SLOT_BYTES, b"\0")


def read_ring(path: Path) -> list[dict]:
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


def read_faults(run_dir: Path, attempt: int) -> dict[int, dict]:
    """The injected faults that fired in one attempt, keyed by global rank."""
    records = {}
    for path in attempt_dir(run_dir, attempt).glob("fault-rank*.json"):
        data = read_json(path)
        if data is not None:
            records[int(path.name.removeprefix("fault-rank").removesuffix(".json"))] = data
    return records


def read_script_checks(run_dir: Path, attempt: int) -> dict[int, dict]:
    """The script-check facts the ranks of one attempt left, keyed by global rank."""
    facts = {}
    for path in attempt_dir(run_dir, attempt).glob("script-check-rank*.json"):
        data = read_json(path)
        if data is not None:
            facts[int(path.name.removeprefix("script-check-rank").removesuffix(".json"))] = data
    return facts


def read_attempt(run_dir: Path, attempt: int) -> tuple[dict[int, dict], dict[int, dict]]:
    """Every rank's latest snapshot and exit record of one attempt, keyed by global rank.

    Each gets the rank's recorded collectives from its ring file under "records".
    """
    snapshots: dict[int, dict] = {}
    exits: dict[int, dict] = {}
    for path in attempt_dir(run_dir, attempt).glob("rank*.json"):
        name = path.name.removeprefix("rank")
        data = read_json(path)
        if data is None:
            continue
        if name.endswith(".exit.json"):
            exits[int(name.removesuffix(".exit.json"))] = data
        else:
            snapshots[int(name.removesuffix(".json"))] = data
    for rank, data in (*snapshots.items(), *exits.items()):
        data["records"] = read_ring(ring_path(run_dir, attempt, rank))
        data["collectives"] = data["records"][-1]["index"] + 1 if data["records"] else 0
    return snapshots, exits
