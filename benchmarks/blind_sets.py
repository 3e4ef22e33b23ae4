"""What the blind-set scorers (run_blind.py, doctor_blind.py) share: a set's manifest, one gradsync
command per script run two at a time, each run's diagnosis.json, and the scores kept with their table.

A blind set is a folder of scripts with a manifest.json (one entry per script) written by someone
who had not read the tool under test; each scorer says how one diagnosis is judged against one
entry, and this module does the rest the same way for both.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

AT_A_TIME = 2


def arguments(description: str, label: str, argv: list[str] | None, extra: Callable[[argparse.ArgumentParser], None] = lambda _: None) -> argparse.Namespace:
    """The scorers' command line: the set's folder, --only, --output (default gradsync_runs/LABEL-SET-TIME)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("folder", type=Path, help="a blind set: scripts and their manifest.json")
    parser.add_argument("--only", default=None, help="comma-separated script names to run (default: all)")
    parser.add_argument("--output", type=Path, default=None, help=f"default gradsync_runs/{label}-<set>-<time>")
    extra(parser)
    args = parser.parse_args(argv)
    args.output = (args.output or Path("gradsync_runs") / f"{label}-{args.folder.name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    return args


def manifest_of(folder: Path, only: str | None) -> dict[str, dict[str, Any]]:
    """script name -> its manifest entry (those named in `only`, comma-separated, when given)."""
    manifest = {entry["script"]: entry for entry in json.loads((folder / "manifest.json").read_text())}
    return {name: manifest[name] for name in only.split(",")} if only else manifest


def run_diagnosed(command: list[str], script: Path, out: Path, timeout_s: float, cwd: Path | None = None) -> tuple[dict[str, Any], int | None, float]:
    """Run one gradsync command on `script` with its run folder under `out` (the command's last
    words before the script are `--run-dir RUN_DIR`, added here); its diagnosis.json ({"findings":
    [], "missing": True} when none was written), return code (None: timed out) and seconds."""
    run_dir = out / script.stem
    started = time.monotonic()
    returncode = None
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(out)}
    try:
        done = subprocess.run([sys.executable, "-m", "gradsync", *command, "--run-dir", str(run_dir), str(script)],
                              capture_output=True, text=True, timeout=timeout_s, env=env, cwd=cwd)
        returncode = done.returncode
        (out / f"{script.stem}.out").write_text(done.stdout + done.stderr)
    except subprocess.TimeoutExpired:
        (out / f"{script.stem}.out").write_text("timed out")
    path = run_dir / "diagnosis.json"
    diagnosis = json.loads(path.read_text()) if path.exists() else {"findings": [], "missing": True}
    return diagnosis, returncode, time.monotonic() - started


def score_set(folder: Path, manifest: dict[str, dict[str, Any]], out: Path, run_one: Callable[[Path, dict[str, Any], Path], Any],
              table: Callable[[list[Any]], str]) -> int:
    """Run every script of the set (two at a time), keep scores.json and table.md in `out`, print the table."""
    out.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=AT_A_TIME) as pool:
        scores = list(pool.map(lambda name: run_one((folder / name).resolve(), manifest[name], out), sorted(manifest)))
    (out / "scores.json").write_text(json.dumps([asdict(s) for s in scores], indent=1) + "\n")
    text = table(scores)
    (out / "table.md").write_text(text + "\n")
    print(text)
    print(f"\n(runs in {out})")
    return 0
