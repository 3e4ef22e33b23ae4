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

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

OPTIONS = ["--nproc-per-node", "2", "--stall-timeout", "10", "--busy-timeout", "30"]
RUN_TIMEOUT_S = 300
AT_A_TIME = 2


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
    run_dir = out / script.stem
    command = [sys.executable, "-m", "gradsync", "run", "--standalone", *OPTIONS, "--run-dir", str(run_dir), str(script)]
    started = time.monotonic()
    returncode = None
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(out)}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env, cwd=script.parent)
        returncode = done.returncode
        (out / f"{script.stem}.out").write_text(done.stdout + done.stderr)
    except subprocess.TimeoutExpired:
        (out / f"{script.stem}.out").write_text("timed out")
    path = run_dir / "diagnosis.json"
    diagnosis = json.loads(path.read_text()) if path.exists() else {"findings": [], "missing": True}
    return score(script, entry, diagnosis, returncode, time.monotonic() - started)


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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a blind set: scripts and their manifest.json")
    parser.add_argument("--only", default=None, help="comma-separated script names to run (default: all)")
    parser.add_argument("--output", type=Path, default=None, help="default gradsync_runs/run-blind-<set>-<time>")
    args = parser.parse_args(argv)
    manifest = {entry["script"]: entry for entry in json.loads((args.folder / "manifest.json").read_text())}
    if args.only:
        manifest = {name: manifest[name] for name in args.only.split(",")}
    out = (args.output or Path("gradsync_runs") / f"run-blind-{args.folder.name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=AT_A_TIME) as pool:
        scores = list(pool.map(lambda name: run_one((args.folder / name).resolve(), manifest[name], out), sorted(manifest)))
    (out / "scores.json").write_text(json.dumps([asdict(s) for s in scores], indent=1) + "\n")
    text = table(scores)
    (out / "table.md").write_text(text + "\n")
    print(text)
    print(f"\n(runs in {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
