"""The checkpoint directory on disk: one folder per step, committed by a manifest written last.

    CHECKPOINT_DIR/
      step-000000120/
        .metadata, __0_0.distcp, __1_0.distcp   DCP's index and each rank's data
        manifest.json                           the commit marker, written last by rank 0

A folder without `manifest.json` is a save that did not finish (a rank died while writing) and
is never loaded. Each rank hashes the files it wrote itself, so checksumming a large checkpoint
is spread over the ranks (`write_rank_checksums`); rank 0 folds those into the manifest once
every rank's part is there (`commit`). The manifest also says which gradsync format wrote it,
the world size, the model's parameter shapes and the position in the data, so resuming can
check all of that before it reads a byte of tensor data.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from gradsync.errors import GradsyncError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"step-(\d+)$")
_CHECKSUMS = "checksums-rank{rank}.json"


class CheckpointError(GradsyncError):
    """A checkpoint cannot be used; the message names the file and what is wrong with it."""


class NewerFormatError(CheckpointError):
    """The checkpoint was written by a newer gradsync whose format this one cannot read."""


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:09d}"


def write_durably(path: Path, text: str) -> None:
    """Replace `path` atomically and make the new contents survive a power cut."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "w") as stream:
            stream.write(text)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)  # a full disk must not keep the half-written copy too
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def file_digest(path: Path) -> dict[str, Any]:
    sha = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(1 << 22):
            sha.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": sha.hexdigest()}


def write_rank_checksums(directory: Path, rank: int) -> None:
    """Hash the files this rank wrote (DCP names them __RANK_*; rank 0 also writes the index)."""
    written = sorted(directory.glob(f"__{rank}_*"))
    if rank == 0:
        written.append(directory / ".metadata")
    digests = {path.name: file_digest(path) for path in written}
    write_durably(directory / _CHECKSUMS.format(rank=rank), json.dumps(digests))


def commit(directory: Path, manifest: dict[str, Any], world_size: int) -> None:
    """Write the manifest (with every rank's checksums): from now on the checkpoint exists."""
    files: dict[str, Any] = {}
    for rank in range(world_size):
        part = directory / _CHECKSUMS.format(rank=rank)
        files.update(json.loads(part.read_text()))
    write_durably(directory / MANIFEST, json.dumps({**manifest, "format": FORMAT_VERSION, "files": files}, indent=1))
    for rank in range(world_size):
        (directory / _CHECKSUMS.format(rank=rank)).unlink(missing_ok=True)


def checkpoint_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every step folder under `root`, newest first, committed or not."""
    if not root.is_dir():
        return []
    found = [(int(m[1]), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found, reverse=True)


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of a committed checkpoint; CheckpointError if there is none or it is unreadable."""
    path = directory / MANIFEST
    if not path.exists():
        raise CheckpointError(f"{directory} has no {MANIFEST}: its save never finished (a rank stopped while writing).")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path} is unreadable ({error}).") from error
    if not isinstance(manifest, dict) or not isinstance(manifest.get("format"), int):
        raise CheckpointError(f"{path} is not a gradsync checkpoint manifest.")
    if manifest["format"] > FORMAT_VERSION:
        raise NewerFormatError(
            f"{directory} was written in checkpoint format {manifest['format']} by gradsync "
            f"{manifest.get('gradsync_version', '?')}; this gradsync ({gradsync_version()}) reads format "
            f"{FORMAT_VERSION} and older. Upgrade gradsync to resume from it."
        )
    return manifest


def verify_files(directory: Path, manifest: dict[str, Any], names: list[str]) -> list[str]:
    """Problems with the named files of a checkpoint (missing, truncated, altered); [] if none."""
    problems = []
    for name in names:
        expected = manifest["files"][name]
        path = directory / name
        if not path.exists():
            problems.append(f"{path} is missing")
            continue
        size = path.stat().st_size
        if size != expected["bytes"]:
            problems.append(f"{path} has {size} bytes, the manifest says {expected['bytes']} (truncated or replaced)")
        elif file_digest(path)["sha256"] != expected["sha256"]:
            problems.append(f"{path} does not match its checksum (corrupted or replaced)")
    return problems


def step_of(path: Path) -> int | None:
    """The step a checkpoint folder's name says (step-000000120 -> 120); None for another name."""
    match = _STEP_DIR.match(Path(path).name)
    return int(match[1]) if match else None


def prune(root: Path, keep: int, newest_step: int) -> list[Path]:
    """Delete all but the `keep` newest committed checkpoints up to `newest_step` (the one just
    committed), and unfinished saves older than the newest of them.

    Folders of later steps are left alone: this run has not reached them, so they are not its
    own (the run will replace each when it saves that step). The manifest goes first, so a crash
    halfway through a deletion leaves an uncommitted folder, never a committed one with files
    missing.
    """
    own = [(step, path) for step, path in checkpoint_dirs(root) if step <= newest_step]
    committed = [path for _, path in own if (path / MANIFEST).exists()]
    if not committed:
        return []
    newest_committed_step = step_of(committed[0])
    assert newest_committed_step is not None
    doomed = committed[keep:] + [
        path for step, path in own if not (path / MANIFEST).exists() and step < newest_committed_step
    ]
    for path in doomed:
        (path / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def remove_unfinished(directory: Path) -> None:
    """Delete a save that failed before its commit (it would never be loaded), freeing its space."""
    if not (directory / MANIFEST).exists():
        shutil.rmtree(directory, ignore_errors=True)


def checkpoint_bytes(directory: Path) -> int | None:
    """The size of a committed checkpoint's files, from its manifest (None if it has none)."""
    try:
        return sum(entry["bytes"] for entry in read_manifest(directory)["files"].values())
    except (CheckpointError, KeyError, TypeError):
        return None


def space_report(root: Path) -> str:
    """Free space on the filesystem of `root`, and what the newest committed checkpoint in it
    takes (the one a resume would use): the numbers someone with a full disk needs."""
    try:
        usage = shutil.disk_usage(root)
        free = f"{_size(usage.free)} free of {_size(usage.total)} on the filesystem of {root}"
    except OSError as error:
        free = f"the free space of {root} cannot be read ({error.strerror or error})"
    for _, path in checkpoint_dirs(root):
        size = checkpoint_bytes(path)
        if size is not None:
            return f"{free}; the newest committed checkpoint, {path.name}, takes {_size(size)} and stays the one to resume from"
    return f"{free}; no checkpoint is committed there yet"


def _size(count: float) -> str:
    for unit in ("B", "KB", "MB"):
        if count < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GB"


def gradsync_version() -> str:
    from gradsync.version import __version__

    return __version__
