"""What a diagnosis was made from (Evidence), kept beside it as `evidence.json`, and the diagnosis
made again from it.

`diagnose` is a pure function of the ranks' views and a few values the monitor gathered (the
trigger, the time, the world size, the stragglers it tracked, the facts --doctor-steps had the
ranks record). Keeping exactly those lets a diagnosis be made again later, with newer rules,
without running the job again: a user's run folder attached to a bug report, or the recorded runs
of tests/run/zoo, which the test suite re-diagnoses instead of launching every script.

A rank's last words are kept as the lines `classify` kept of its log, and classified again when
read, so a re-made diagnosis reads them with the current families too.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradsync.run.analysis.last_words import classify
from gradsync.run.analysis.rules import diagnose
from gradsync.run.analysis.views import RankView
from gradsync.rundir import read_json
from gradsync.rundir.records import Finding

if TYPE_CHECKING:
    from gradsync.run.moments import ScriptProbe

# Bumped when what is kept changes shape: evidence of another format is refused, not misread.
FORMAT = 1
# A view's fields kept as they are: its rank is the key it is kept under, its last words are kept as lines.
_KEPT_FIELDS = [f.name for f in fields(RankView) if f.name not in ("rank", "last_words")]


@dataclass
class Evidence:
    """The inputs of one `diagnose` call."""

    views: dict[int, RankView]
    trigger: str
    now: float
    world_size: int | None = None
    stragglers: list[Finding] = field(default_factory=list)
    # rank -> the facts --doctor-steps had it record (its rules are run on them again, too)
    script_checks: dict[int, dict[str, Any]] = field(default_factory=dict)

    def diagnose(self, probe: ScriptProbe | None = None) -> dict[str, Any]:
        """The diagnosis; `probe`: the rules the --doctor-steps facts are judged by (those of the
        probe the run carried: its launcher's, or the command line's for kept evidence), None to
        leave them unjudged."""
        script_check = probe.findings(self.script_checks) if probe is not None and self.script_checks else []
        return diagnose(
            self.views,
            trigger=self.trigger,
            now=self.now,
            world_size=self.world_size,
            stragglers=self.stragglers,
            script_check=script_check,
            explained=probe.explained_by(script_check) if probe is not None else set(),
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "trigger": self.trigger,
            "now": self.now,
            "world_size": self.world_size,
            "ranks": {str(rank): _view_as_dict(view) for rank, view in sorted(self.views.items())},
            "stragglers": [finding.as_dict() for finding in self.stragglers],
            "script_checks": {str(rank): facts for rank, facts in sorted(self.script_checks.items())},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Evidence:
        if data.get("format") != FORMAT:
            raise ValueError(f"evidence of format {data.get('format')!r}; this gradsync reads format {FORMAT}")
        return cls(
            views={int(rank): _view_from_dict(int(rank), view) for rank, view in data["ranks"].items()},
            trigger=data["trigger"],
            now=data["now"],
            world_size=data["world_size"],
            stragglers=[Finding(**finding) for finding in data["stragglers"]],
            script_checks={int(rank): facts for rank, facts in data["script_checks"].items()},
        )


def read_evidence(path: Path) -> Evidence | None:
    """The evidence kept at `path`; None when there is none (a run of an older gradsync)."""
    data = read_json(path)
    return None if data is None else Evidence.from_dict(data)


def _view_as_dict(view: RankView) -> dict[str, Any]:
    kept = {name: getattr(view, name) for name in _KEPT_FIELDS}
    kept["last_words"] = None if view.last_words is None else list(view.last_words.lines)
    return kept


def _view_from_dict(rank: int, kept: dict[str, Any]) -> RankView:
    lines = kept.get("last_words")
    view = RankView(rank, **{name: kept[name] for name in _KEPT_FIELDS if name in kept})
    view.last_words = None if lines is None else classify("\n".join(lines))
    return view
