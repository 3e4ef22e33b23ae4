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

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

RUN_TIMEOUT_S = 400
AT_A_TIME = 2


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
    run_dir = out / script.stem
    command = [sys.executable, "-m", "gradsync", "doctor", "--nproc-per-node", "2", "--steps", str(steps),
               "--run-dir", str(run_dir), str(script)]
    started = time.monotonic()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(out)}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env)
        (out / f"{script.stem}.out").write_text(done.stdout + done.stderr)
    except subprocess.TimeoutExpired:
        (out / f"{script.stem}.out").write_text("timed out")
    path = run_dir / "diagnosis.json"
    diagnosis = json.loads(path.read_text()) if path.exists() else {"findings": [], "missing": True}
    return score(script, entry, diagnosis, time.monotonic() - started)


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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a blind set: scripts and their manifest.json")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--only", default=None, help="comma-separated script names to run (default: all)")
    parser.add_argument("--output", type=Path, default=None, help="default gradsync_runs/doctor-blind-<set>-<time>")
    args = parser.parse_args(argv)
    manifest = {entry["script"]: entry for entry in json.loads((args.folder / "manifest.json").read_text())}
    if args.only:
        manifest = {name: manifest[name] for name in args.only.split(",")}
    out = (args.output or Path("gradsync_runs") / f"doctor-blind-{args.folder.name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=AT_A_TIME) as pool:
        scores = list(pool.map(lambda name: run_one((args.folder / name).resolve(), manifest[name], args.steps, out),
                               sorted(manifest)))
    (out / "scores.json").write_text(json.dumps([asdict(s) for s in scores], indent=1) + "\n")
    text = table(scores)
    (out / "table.md").write_text(text + "\n")
    print(text)
    print(f"\n(runs in {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
