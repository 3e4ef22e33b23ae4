"""Score `gradsync doctor --steps K` on a blind set of scripts: does it name each mistake's cause?

A blind set (benchmarks/doctor_blind/setN/) is written by someone who has not read the doctor,
from public reports of data-parallel jobs that run without error and train wrong, with a
manifest.json saying, per script, whether it is a mistake or a healthy look-alike, the line(s)
that make the mistake and the rank(s) that do it when only some do. Each script runs once under
`gradsync doctor --nproc-per-node 2 --steps K`, and is scored from its diagnosis.json:

- a mistake is **named** when a finding places one of its cause lines (on a cause rank, and names
  only cause ranks, when the manifest gives them); **flagged** when any finding was made;
- a healthy look-alike is **clean** when no finding was made (a warning counts) and the script
  was not stopped by a failure.

    python benchmarks/doctor_blind.py benchmarks/doctor_blind/set1 [--steps 20] [--output DIR]

The measurement runs whatever gradsync Python imports: PYTHONPATH=<another checkout>/src measures
that checkout with this one's scoring (how the before-and-after counts are taken).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repository's root
from benchmarks.blind_sets import arguments, manifest_of, run_diagnosed, score_set  # noqa: E402

RUN_TIMEOUT_S = 400


@dataclass
class Score:
    script: str
    kind: str  # "mistake" or "healthy"
    cls: str
    verdict: str  # named / line, rank wrong / flagged / missed / clean / flagged healthy / failed
    findings: list[str]  # "category@rank:file:line" of each finding
    seconds: float


def _matches(location: str, script: Path, lines: list[int]) -> bool:
    path, _, line = location.rpartition(":")
    return Path(path).name == script.name and line.isdigit() and int(line) in lines


def score(script: Path, entry: dict, diagnosis: dict, seconds: float) -> Score:
    findings = diagnosis.get("findings", [])
    said = [f"{f['category']}@{','.join(map(str, f['ranks']))}:" + ";".join(sorted(set(f.get("locations", {}).values())))
            for f in findings]
    failed = any(f["category"] in ("script_failed", "rank_crashed") for f in findings) or diagnosis.get("missing")
    if entry["kind"] == "healthy":
        verdict = "clean" if not findings and not failed else "failed" if failed else "flagged healthy"
        return Score(script.name, "healthy", entry.get("class", ""), verdict, said, seconds)
    lines, ranks = entry["cause_lines"], set(entry.get("cause_ranks") or [])
    verdict = "missed"
    for finding in findings:
        placed = {int(rank) for rank, location in finding.get("locations", {}).items() if _matches(location, script, lines)}
        if not placed:
            continue
        if not ranks or (placed & ranks and set(finding["ranks"]) <= ranks):
            verdict = "named"
            break
        verdict = "line, rank wrong"
    if verdict == "missed" and findings:
        verdict = "failed" if failed else "flagged"
    return Score(script.name, "mistake", entry.get("class", ""), verdict, said, seconds)


def run_one(script: Path, entry: dict, steps: int, out: Path) -> Score:
    diagnosis, _, seconds = run_diagnosed(["doctor", "--nproc-per-node", "2", "--steps", str(steps)], script, out, RUN_TIMEOUT_S)
    return score(script, entry, diagnosis, seconds)


def table(scores: list[Score]) -> str:
    rows = ["| script | kind | class | verdict | findings |", "|---|---|---|---|---|"]
    for s in scores:
        rows.append(f"| {s.script} | {s.kind} | {s.cls} | **{s.verdict}** | {'<br>'.join(s.findings) or '-'} |")
    mistakes = [s for s in scores if s.kind == "mistake"]
    healthy = [s for s in scores if s.kind == "healthy"]
    named = sum(s.verdict == "named" for s in mistakes)
    flagged = sum(s.verdict != "missed" for s in mistakes)
    clean = sum(s.verdict == "clean" for s in healthy)
    rows.append("")
    rows.append(f"named at the cause: {named} of {len(mistakes)}; flagged: {flagged} of {len(mistakes)}; "
                f"healthy clean: {clean} of {len(healthy)}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__.split("\n\n")[0], "doctor-blind", argv,
                     lambda parser: parser.add_argument("--steps", type=int, default=20))
    return score_set(args.folder, manifest_of(args.folder, args.only), args.output,
                     lambda script, entry, out: run_one(script, entry, args.steps, out), table)


if __name__ == "__main__":
    sys.exit(main())
