"""Score `gradsync run` on a blind set of scripts: does its verdict name the rank and the line at fault?

A blind set (benchmarks/run_blind/setN/) is written by someone who has not read `gradsync run`,
from public reports of distributed jobs that hang, crash or never exit, with a manifest.json
saying, per script, whether it fails or is a healthy look-alike, what plain torchrun showed, the
line(s) where the cause lies and the rank(s) at fault when only some are. Each script runs once
under `gradsync run --nproc-per-node 2 --stall-timeout 10 --busy-timeout 30` and is scored from
its diagnosis.json:

- a failing script is **right** when the verdict (the first error finding) places one of its
  cause lines on a cause rank and names only cause ranks (any rank, when the manifest gives none);
  **rank right** when it names the cause ranks elsewhere; **wrong** when it names others;
  **missed** when the job was called healthy;
- a healthy look-alike is **right** when it exits 0 with no error finding (a warning counts
  as right: it does not stop the job), **stopped** otherwise.

    python benchmarks/run_blind.py benchmarks/run_blind/set1 [--only a.py,b.py] [--output DIR]

The measurement runs whatever gradsync Python imports: PYTHONPATH=<another checkout>/src measures
that checkout with this one's scoring (how the before-and-after counts are taken).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repository's root
from benchmarks.blind_sets import arguments, manifest_of, run_diagnosed, score_set  # noqa: E402

OPTIONS = ["--nproc-per-node", "2", "--stall-timeout", "10", "--busy-timeout", "30"]
RUN_TIMEOUT_S = 300


@dataclass
class Score:
    script: str
    kind: str  # "failing" or "healthy"
    cls: str
    verdict: str  # right / rank right / wrong / missed / stopped
    said: str  # "category@ranks:locations" of the verdict
    returncode: int | None
    seconds: float


def _at(location: str, script: Path, lines: list[int]) -> bool:
    path, _, line = location.rpartition(":")
    return Path(path).name == script.name and line.isdigit() and int(line) in lines


def score(script: Path, entry: dict, diagnosis: dict, returncode: int | None, seconds: float) -> Score:
    errors = [f for f in diagnosis.get("findings", []) if f.get("severity") == "error"]
    verdict_finding = errors[0] if errors else None
    said = "-" if verdict_finding is None else (
        f"{verdict_finding['category']}@{','.join(map(str, verdict_finding['ranks']))}:"
        + ";".join(f"{rank}={where}" for rank, where in sorted(verdict_finding.get("locations", {}).items())))
    if entry["kind"] == "healthy":
        verdict = "right" if returncode == 0 and verdict_finding is None else "stopped"
        return Score(script.name, "healthy", entry.get("class", ""), verdict, said, returncode, seconds)
    if verdict_finding is None:
        return Score(script.name, "failing", entry.get("class", ""), "missed", said, returncode, seconds)
    lines, ranks = entry["cause_lines"], set(entry.get("cause_ranks") or [])
    named = set(verdict_finding["ranks"])
    placed = {int(rank) for rank, where in verdict_finding.get("locations", {}).items() if _at(where, script, lines)}
    ranks_right = not ranks or (named <= ranks and bool(named & ranks))
    if ranks_right and (placed & ranks if ranks else placed):
        verdict = "right"
    elif ranks_right:
        verdict = "rank right"
    else:
        verdict = "wrong"
    return Score(script.name, "failing", entry.get("class", ""), verdict, said, returncode, seconds)


def run_one(script: Path, entry: dict, out: Path) -> Score:
    diagnosis, returncode, seconds = run_diagnosed(["run", "--standalone", *OPTIONS], script, out, RUN_TIMEOUT_S, cwd=script.parent)
    return score(script, entry, diagnosis, returncode, seconds)


def table(scores: list[Score]) -> str:
    rows = ["| script | kind | class | verdict | said |", "|---|---|---|---|---|"]
    for s in scores:
        rows.append(f"| {s.script} | {s.kind} | {s.cls} | **{s.verdict}** | {s.said} |")
    right = sum(s.verdict == "right" for s in scores)
    failing = [s for s in scores if s.kind == "failing"]
    healthy = [s for s in scores if s.kind == "healthy"]
    rows.append("")
    rows.append(f"right: {right} of {len(scores)} ({right / max(1, len(scores)):.0%}); failing right: "
                f"{sum(s.verdict == 'right' for s in failing)} of {len(failing)} (rank right, line not: "
                f"{sum(s.verdict == 'rank right' for s in failing)}); healthy right: "
                f"{sum(s.verdict == 'right' for s in healthy)} of {len(healthy)}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__.split("\n\n")[0], "run-blind", argv)
    return score_set(args.folder, manifest_of(args.folder, args.only), args.output, run_one, table)


if __name__ == "__main__":
    sys.exit(main())
