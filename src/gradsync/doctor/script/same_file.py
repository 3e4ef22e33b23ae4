"""same_file: several ranks of one host wrote the same path.

The writes overlap, and the file that survives holds one random rank's data, or a mix of several:
a torn checkpoint with torch.save (an error), a garbled file with the script's own open (a
warning). Each host's own disk is its own: only ranks of one host are compared. At most three
paths are named. Each rank records the paths it wrote with `torch.save` or with `open` called
from the script's own files (libraries open files of their own), the first MAX_WRITES of them.
"""

from __future__ import annotations

import os
import socket
from collections import Counter
from typing import Any, TypedDict

from gradsync.rundir.records import Finding
from gradsync.callsite import caller_location
from gradsync.run.check_primitives import Patches
from gradsync.run.harmless import BookkeepingByKind
from gradsync.doctor.script.compare import ranks_text
from gradsync.run.moments import Moments
from gradsync.doctor.script.shared_facts import own_facts
from gradsync.doctor.script.unit import Category, Check, RankFacts

NAME = "same_file"
MAX_WRITES = 64  # paths kept per rank


class WriteFacts(TypedDict):
    """What the watch records on one rank (under "same_file" in its facts file)."""

    host: str  # the rank's host name: only ranks of one host share a disk
    writes: list[dict[str, Any]]  # {"path", "how", "step", "site"}


class WriteWatch:
    """The paths one rank wrote with `torch.save` or the script's own `open`, with the step and line."""

    def __init__(self, moments: Moments, bookkeeping: BookkeepingByKind) -> None:
        self.moments = moments
        self.bookkeeping = bookkeeping[f"the {NAME} check's watch"]
        self.writes: list[dict[str, Any]] = []
        moments.on("file_written", self._wrote, self.bookkeeping)

    def install(self, patches: Patches) -> None:
        """Nothing beyond the host's moments."""

    def _wrote(self, file: Any, how: str) -> None:
        if not isinstance(file, (str, os.PathLike)) or len(self.writes) >= MAX_WRITES:
            return
        path = os.path.abspath(os.fspath(file))
        if path.startswith(("/dev/", "/proc/", "/sys/")):
            return
        self.writes.append({"path": path, "how": how, "step": self.moments.steps, "site": caller_location()})

    def facts(self) -> WriteFacts:
        return {"host": socket.gethostname(), "writes": self.writes}


def same_file_written(checks: RankFacts) -> list[Finding]:
    recorded = own_facts(checks, NAME)
    if recorded is None:
        return []
    writers: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}
    for rank, facts in recorded.items():
        for write in facts["writes"]:
            writers.setdefault((facts["host"], write["path"]), {}).setdefault(rank, write)
    findings = []
    for (host, path), by_rank in sorted(writers.items()):
        if len(by_rank) < 2:
            continue
        ranks = sorted(by_rank)
        saves = any(w["how"] == "torch.save" for w in by_rank.values())
        together = Counter(w["step"] for w in by_rank.values()).most_common(1)[0][1] > 1
        site = by_rank[ranks[0]]["site"] or "?"
        findings.append(Finding(
            "same_file_written",
            "error" if saves else "warning",
            ranks,
            f"{ranks_text(ranks).capitalize()} on host {host} all wrote {path} (with {by_rank[ranks[0]]['how']} at {site})"
            f"{', at the same step' if together else ''}: the writes overlap, and the file that survives holds one "
            "random rank's data, or a mix of several" + (" (a torn checkpoint)." if saves else "."),
            "Write from one rank (`if dist.get_rank() == 0:` and a barrier before others read it), or give each rank "
            "its own path (f'...rank{rank}.pt'); for sharded state use torch.distributed.checkpoint, "
            "which writes one file per rank by design.",
            locations={str(r): by_rank[r]["site"] or "?" for r in ranks},
            details={"path": path},
        ))
        if len(findings) >= 3:
            break
    return findings


CHECK = Check(
    name="same_file",
    summary="several ranks writing the same file",
    categories={
        "same_file_written": Category(
            ("error", "warning"),
            "several ranks wrote the same file: overlapping writes",
            "several ranks of one host wrote the same path (error with `torch.save`, warning with the user's own "
            "`open`): overlapping writes, a torn or random rank's file",
        ),
    },
    rule=same_file_written,
    watch=WriteWatch,
    facts=WriteFacts,
)
