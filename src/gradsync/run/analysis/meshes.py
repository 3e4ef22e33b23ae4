"""Ranks that built different device meshes: named as the cause of whatever error was found."""

from __future__ import annotations

from typing import Any

from gradsync.run.analysis.views import RankView
from gradsync.run.analysis.wording import listing
from gradsync.rundir.records import Finding


def blame_differing_meshes(findings: list[Finding], views: dict[int, RankView]) -> None:
    """When the ranks built different device meshes, that is the cause of the error found.

    A mesh's groups are created collectively, one per dimension: ranks that asked for different
    shapes hold groups their peers do not, so their collectives meet the wrong peers or none.
    Whatever that looked like (a hang, a mismatch, a crash), the first differing mesh is named.
    """
    error = next((f for f in findings if f.severity == "error" and "injected" not in f.details), None)
    meshes = {r: v.snapshot.get("meshes") for r, v in sorted(views.items()) if v.snapshot and v.snapshot.get("meshes") is not None}
    if error is None or len(meshes) < 2:
        return
    for index in range(max(len(m) for m in meshes.values())):
        built = {r: m[index] if index < len(m) else None for r, m in meshes.items()}
        if len({None if b is None else (tuple(b["shape"]), tuple(b["names"] or ())) for b in built.values()}) < 2:
            continue
        sides = listing([
            (r, f"rank {r}: " + ("none" if b is None else
                                 f"shape {tuple(b['shape'])}" + (f" {tuple(b['names'])}" if b["names"] else "") + f" at {b['site'] or '?'}"))
            for r, b in built.items()
        ])
        error.message = (
            f"The ranks built different device meshes (their mesh #{index + 1}: {sides}), so each holds process "
            f"groups the others do not and their collectives met the wrong peers. What followed: {error.message}"
        )
        error.suggestion = (
            "Build every device mesh from values all ranks share (the world size, a config read the same way "
            "everywhere), never from a rank's own environment. " + error.suggestion
        )
        # The line to fix is where the meshes were built, whatever line the symptom showed at.
        error.locations = {str(r): b["site"] or "?" for r, b in built.items() if b is not None}
        error.ranks = _odd_meshes(built)
        error.details["meshes"] = {str(r): b for r, b in built.items()}
        return


def _odd_meshes(built: dict[int, dict[str, Any] | None]) -> list[int]:
    """The ranks whose mesh differs from most ranks'; where none is most, the ranks that built one
    the others did not build at all (an extra creation), else every rank."""
    alike: dict[Any, list[int]] = {}
    for rank, mesh in built.items():
        alike.setdefault(None if mesh is None else (tuple(mesh["shape"]), tuple(mesh["names"] or ())), []).append(rank)
    sizes = sorted(len(ranks) for ranks in alike.values())
    if sizes[-2] < sizes[-1]:
        return sorted(r for ranks in alike.values() if len(ranks) < sizes[-1] for r in ranks)
    if None in alike:
        return sorted(r for r, mesh in built.items() if mesh is not None)
    return sorted(built)
