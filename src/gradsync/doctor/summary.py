"""The doctor's report: every rank's checks merged into lines, shown as a table or as JSON.

A check that came out the same on every rank is one line; where ranks differ, one line per group
of ranks with the same result, labelled with the ranks (and hosts). The terminal table puts the
verdict first and the fix under every non-ok line; `--json` gives the same lines for machines:
{"status", "checks": [{"name", "verdict", "value", "message", "fix", "rank" | "ranks"?}], ...}.
"""

from __future__ import annotations

import io
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from gradsync.doctor.checks import Check, Verdict, ranks_text, worst

# One step of the report: the same kind of check on each rank (merged), or one cross-rank check.
Entry = Mapping[int, Sequence[Check]] | Check


@dataclass(frozen=True)
class Line:
    check: Check
    ranks: tuple[int, ...] | None = None  # None: the same on every rank


@dataclass(frozen=True)
class RankInfo:
    rank: int
    host: str
    local_rank: int


@dataclass(frozen=True)
class Report:
    lines: tuple[Line, ...]
    ranks: tuple[RankInfo, ...]
    elapsed_s: float
    scope: str | None = None  # set when the report covers fewer ranks than the job (e.g. a rank left alone)

    @property
    def status(self) -> Verdict:
        return worst(line.check.verdict for line in self.lines)

    @property
    def hosts(self) -> list[str]:
        return list(dict.fromkeys(r.host for r in self.ranks))

    def to_json(self) -> dict[str, Any]:
        checks = []
        for line in self.lines:
            c = line.check
            item: dict[str, Any] = {"name": c.name, "verdict": c.verdict, "value": c.value, "message": c.message,
                                    "fix": c.fix}
            if line.ranks is not None:
                if len(line.ranks) == 1:
                    item["rank"] = line.ranks[0]
                else:
                    item["ranks"] = list(line.ranks)
            checks.append(item)
        data: dict[str, Any] = {
            "status": self.status,
            "checks": checks,
            "world_size": len(self.ranks),
            "hosts": self.hosts,
            "ranks": [{"rank": r.rank, "host": r.host, "local_rank": r.local_rank} for r in self.ranks],
            "elapsed_s": round(self.elapsed_s, 2),
        }
        if self.scope:
            data["scope"] = self.scope
        return data


def merge(entries: Sequence[Entry], all_ranks: Sequence[int]) -> list[Line]:
    """Lines from entries: per-rank checks grouped by identical result, cross-rank checks as they are."""
    everyone = tuple(sorted(all_ranks))
    lines: list[Line] = []
    for entry in entries:
        if isinstance(entry, Check):
            lines.append(Line(entry))
            continue
        names = list(dict.fromkeys(c.name for rank in sorted(entry) for c in entry[rank]))
        for name in names:
            groups: dict[Check, list[int]] = {}
            for rank in sorted(entry):
                for check in entry[rank]:
                    if check.name == name:
                        groups.setdefault(check, []).append(rank)
            if len(groups) == 1 and tuple(next(iter(groups.values()))) == everyone:
                lines.append(Line(next(iter(groups))))
            else:
                lines.extend(Line(check, tuple(ranks)) for check, ranks in groups.items())
    return lines


_STYLE = {"ok": "green", "warning": "yellow", "problem": "bold red"}


def _label(line: Line, hosts: Mapping[int, str], several_hosts: bool) -> str:
    if line.ranks is None:
        return line.check.name
    where = ranks_text(line.ranks)
    if several_hosts:
        where += " · " + ",".join(dict.fromkeys(hosts[r] for r in line.ranks if r in hosts))
    return f"{line.check.name} [{where}]"


def render(report: Report, width: int | None = None, color: bool | None = None) -> str:
    """The terminal table: verdict, check, result; message and fix under non-ok lines."""
    hosts = {r.rank: r.host for r in report.ranks}
    several = len(report.hosts) > 1
    if color is None:  # colors when the report goes to a terminal (NO_COLOR is honoured)
        color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    buffer = io.StringIO()
    console = Console(file=buffer, width=width or shutil.get_terminal_size((110, 24)).columns,
                      force_terminal=color, no_color=not color, highlight=False, soft_wrap=False)
    counts = {v: sum(1 for line in report.lines if line.check.verdict == v) for v in ("warning", "problem")}
    header = Text("gradsync doctor: ")
    header.append(report.status.upper(), style=_STYLE[report.status])
    n = len(report.ranks)
    header.append(f"  {n} rank{'s' if n != 1 else ''} on {len(report.hosts)} host{'s' if several else ''} "
                  f"({', '.join(report.hosts)}), {report.elapsed_s:.{1 if report.elapsed_s >= 1 else 2}f} s; "
                  f"{counts['warning']} warning(s), {counts['problem']} problem(s)")
    console.print(header)
    if report.scope:
        console.print(Text(report.scope, style="yellow"))
    table = Table.grid(padding=(0, 2))
    table.add_column(no_wrap=True)
    table.add_column(no_wrap=True)
    table.add_column(overflow="fold")
    for line in report.lines:
        c = line.check
        result = Text(c.value)
        if c.verdict != "ok":
            result.append(f" — {c.message}")
        table.add_row(Text(c.verdict, style=_STYLE[c.verdict]), Text(_label(line, hosts, several)), result)
        if c.verdict != "ok" and c.fix:
            table.add_row("", "", Text(f"fix: {c.fix}", style="cyan"))
    console.print(table)
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines()) + "\n"
