"""PyTorch's Flight Recorder as gradsync run's record of everything that reached a process group.

Why a second record: gradsync's recorder sees the Python calls it wraps, but DTensor
(`full_tensor()`, `redistribute`, tensor-parallel layers), functional and compiled collectives,
`ProcessGroup` methods and coalesced ops reach the process group without passing through them.
Flight Recorder sits in the process group itself (C++), so it sees all of them, each with its
group, its sequence number in that group, op, sizes, dtypes and state. What it lacks is the
user's line: that comes from the recorder's ring, whose records span the entries they caused
(`join_sites`), or for the entry a rank is blocked in, from the rank's stack.

Completion, by backend:
- NCCL: a collective's Python call returns once the work is *enqueued* on the GPU stream, so
  "the call returned" means nothing there. Flight Recorder's entry goes `scheduled` -> `started`
  (with TORCH_NCCL_ENABLE_TIMING) -> `completed` as the watchdog sees the CUDA events, and is
  `retired` when the work is dropped. An entry neither completed nor retired is still running:
  the rank waits in it, whatever its Python thread does next.
- Gloo: the state stays `scheduled`; `retired` marks a work that finished, and the group's
  status (`pg_status`) counts the last completed collective.

The worker turns the recorder on for the user (`enable`, before the script creates a process
group: TORCH_FR_BUFFER_SIZE, which a torch that records Gloo reads for NCCL too, else
TORCH_NCCL_TRACE_BUFFER_SIZE; a value the user set wins) and dumps it when the rank has been
quiet for a while and when it exits (`dump`): a compact JSON file for the analysis, and torch's
own pickle, which PyTorch's analyser reads
(`python -m torch.distributed.flight_recorder.fr_trace RUN_DIR/workers/attemptN/flight -p rank_`).
"""

from __future__ import annotations

import os
import pickle
import time
from bisect import bisect_right
from pathlib import Path
from typing import Any

from gradsync import compat
from gradsync.rundir import write_bytes, write_json

# A torch that records Gloo reads the first for every backend (and calls the second deprecated);
# older releases read only the second, for NCCL.
BUFFER_VARIABLE = "TORCH_FR_BUFFER_SIZE"
NCCL_BUFFER_VARIABLE = "TORCH_NCCL_TRACE_BUFFER_SIZE"
KEPT_ENTRIES = 512  # the newest entries the compact file keeps: the analysis needs the recent past


def enable(entries: int) -> bool:
    """Turn Flight Recorder on for process groups this process creates from now on; False when
    `entries` is 0 or the user turned it off (set the variables to 0)."""
    if entries <= 0:
        return False
    names = (BUFFER_VARIABLE,) if compat.FR_PICKLE.available() else (NCCL_BUFFER_VARIABLE,)
    for name in names:
        os.environ.setdefault(name, str(entries))
    return any(_positive(os.environ.get(name)) for name in (BUFFER_VARIABLE, NCCL_BUFFER_VARIABLE))


def _positive(value: str | None) -> bool:
    try:
        return int(value or 0) > 0
    except ValueError:
        return False


def _dumpers() -> list[Any]:
    """The dump function of each Flight Recorder this torch has: NCCL's (CUDA builds), Gloo's."""
    return [dumper for dumper in (compat.FR_NCCL_PICKLE.get(), compat.FR_PICKLE.get()) if dumper is not None]


def dump(compact_path: Path, raw_folder: Path, rank: int, known_groups: list[tuple[str, str, list[int]]]) -> bool:
    """Write this process's Flight Recorder entries: compact JSON at `compact_path`, torch's pickle
    as `raw_folder/rank_<rank>`. False when there is nothing to write.

    `known_groups`: the process groups last seen alive (`process_groups`), used once the script
    has destroyed them: the entries outlive the groups, and torch's analyser needs the groups."""
    groups = process_groups() or known_groups
    entries: list[dict[str, Any]] = []
    status: dict[str, Any] = {}
    raw: dict[str, Any] | None = None
    for dumper in _dumpers():
        try:
            # Without stacks: the first symbolisation of them takes 4-6 s here; lines come from the
            # recorder's records and the rank's own stack instead.
            data = pickle.loads(dumper(True, False, False))
        except (RuntimeError, pickle.UnpicklingError, EOFError, ValueError):
            continue
        if not data.get("entries"):
            continue
        entries += data["entries"]
        status.update(data.get("pg_status") or {})
        raw = raw or data
    if raw is None:
        return False
    members = {group_key(name, description): ranks for name, description, ranks in groups}
    write_json(compact_path, compact(entries, status, members, time.time()))
    write_bytes(raw_folder / f"rank_{rank}", pickle.dumps(_with_group_config(raw, groups)))
    return True


def _with_group_config(data: dict[str, Any], groups: list[tuple[str, str, list[int]]]) -> dict[str, Any]:
    """torch's dump with each group's name, description and members filled in where the backend
    left them out (Gloo does): torch's analyser needs them to read the dump at all."""
    config = {key: value for key, value in (data.get("pg_config") or {}).items() if key}
    for name, description, ranks in groups:
        config.setdefault(name, {"name": name, "desc": description, "ranks": str(ranks)})
    return {**data, "pg_config": config}


def process_groups() -> list[tuple[str, str, list[int]]]:
    """(name, description, global ranks) of every process group this process knows; Flight
    Recorder names groups but, on Gloo, not their members."""
    world = compat.C10D_WORLD.get()
    try:
        return [
            (str(name), str(getattr(group, "group_desc", "") or ""), sorted(world.pg_group_ranks.get(group, {})))
            for group, name in world.pg_names.items()
        ]
    except (AttributeError, RuntimeError):
        return []


def group_key(name: str, description: str) -> str:
    """The recorder's name for a group ("default", "group NAME"), from Flight Recorder's."""
    return "default" if description == "default_pg" or name == "0" else f"group {name}"


def _signature(entry: dict[str, Any]) -> str:
    sizes = entry.get("input_sizes") or []
    dtypes = entry.get("input_dtypes") or []
    return ", ".join(f"{dtype}{list(size)}" for dtype, size in zip(dtypes, sizes))


def _completed(entry: dict[str, Any], status: dict[str, Any]) -> bool:
    if entry.get("state") == "completed" or entry.get("retired"):
        return True
    last = (status.get(str(entry.get("pg_id"))) or {}).get("last_completed_collective")
    try:
        return not entry.get("is_p2p") and int(last) >= int(entry.get("collective_seq_id", -1)) > 0
    except (TypeError, ValueError):
        return False


def compact(entries: list[dict[str, Any]], status: dict[str, Any], members: dict[str, list[int]], now: float) -> dict[str, Any]:
    """What the analysis reads of a dump, in the shape of the recorder's ring records (site and
    kind still empty: `join_sites` fills them): the newest KEPT_ENTRIES entries."""
    records = []
    for entry in sorted(entries, key=lambda e: e.get("time_created_ns", 0))[-KEPT_ENTRIES:]:
        name, description = (list(entry.get("process_group") or ["", ""]) + ["", ""])[:2]
        op = str(entry.get("profiling_name", "?")).split(":", 1)[-1]
        point_to_point = bool(entry.get("is_p2p"))
        records.append({
            "group": group_key(str(name), str(description)),
            "seq": None if point_to_point else entry.get("collective_seq_id"),
            "op": op,
            "signature": _signature(entry),
            "kind": "",
            "site": None,
            "state": "finished" if _completed(entry, status) else "entered",
            "entered": entry.get("time_created_ns", 0) / 1e9,
            "finished": None,
            "backend_state": entry.get("state"),
            "source": "flight",
        })
    return {"time": now, "entries": records, "groups": members}


def join_sites(entries: list[dict[str, Any]], ring: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each entry with the user's line and kind of the recorded call it came from: the ring record
    on the same group whose time span (entered .. finished, or still open) holds the entry's
    creation. DDP's buckets get the backward pass's line; an all_gather_object's two all_gathers
    the line of the call. Entries no record spans (DTensor, functional, compiled) keep site None."""
    by_group: dict[str, list[dict[str, Any]]] = {}
    for record in ring:
        by_group.setdefault(record["group"], []).append(record)
    starts = {group: [r["entered"] for r in records] for group, records in by_group.items()}
    joined = []
    for entry in entries:
        records = by_group.get(entry["group"], [])
        # Both clocks are the wall clock: a call is entered before its entries are created, and
        # returns after (an entry just after a return belongs to the next call, not that one).
        index = bisect_right(starts.get(entry["group"], []), entry["entered"]) - 1
        site = kind = None
        # Spans on one group do not overlap on the training thread; look back a few for async ones.
        for record in records[max(0, index - 4) : index + 1][::-1]:
            end = record.get("finished")
            if end is None or entry["entered"] <= end:
                site, kind = record.get("site"), record.get("kind") or ""
                break
        joined.append({**entry, "site": site, "kind": kind or ""} if site is not None else entry)
    return joined
