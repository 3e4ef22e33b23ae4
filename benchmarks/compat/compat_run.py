"""Run each framework script under plain torchrun and under `gradsync run`, and print the table.

Called by run_all.sh with the compat virtual environment's Python (standard library only here):

    python compat_run.py --bin VENV/bin --workdir DIR [--rounds 2] [--only accelerate,lightning]

Per framework, `--rounds` rounds of one torchrun launch and one `gradsync run` launch, the order
alternating between rounds (ABBA) so that drift in the machine's load hits both alike. Each launch:
exit code, wall time, the script's `final:` line; for gradsync, diagnosis.json (status, findings).
Then the broken Accelerate variant (a barrier only rank 0 calls) under `gradsync run
--stall-timeout 20`, and under torchrun killed after --hang-limit seconds. Results go to
DIR/results.json and DIR/table.md; the table is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = {
    "accelerate": ("Hugging Face Accelerate", "accelerate", HERE / "accelerate_train.py"),
    "lightning": ("PyTorch Lightning", "lightning", HERE / "lightning_train.py"),
    "hf_trainer": ("Hugging Face Trainer", "transformers", HERE / "hf_trainer_train.py"),
}
BROKEN = HERE / "accelerate_train.py"
BACKEND_LINE = re.compile(r"^(\[rank\d+\]:)?\[?[IWEF]\d{4} \d\d:\d\d:\d\d")


def version(bin_dir: Path, dist: str) -> str:
    out = subprocess.run([str(bin_dir / "python"), "-c", f"import importlib.metadata as m; print(m.version('{dist}'))"],
                         capture_output=True, text=True)
    return out.stdout.strip() or "not installed"


def launch(cmd: list[str], cwd: Path, log: Path, limit_s: float) -> dict:
    """Run one launch with its output to `log` (not a terminal, as in a batch job)."""
    start = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(limit_s)
            killed = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)  # the launcher forwards it to its workers
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc, killed = proc.returncode, True
    wall = time.monotonic() - start
    text = log.read_text(errors="replace")
    lines = [line for line in text.splitlines() if not BACKEND_LINE.match(line)]
    final = [line for line in lines if line.startswith("final:")]
    return {"cmd": " ".join(cmd), "rc": rc, "killed_after_s": limit_s if killed else None, "wall_s": round(wall, 2),
            "final": final[-1] if final else None, "log": str(log), "script_lines": lines}


def diagnosis(result: dict, run_dir: Path) -> dict:
    printed = re.findall(r"diagnosis: (\S+diagnosis\.json)", "\n".join(result["script_lines"]))
    path = run_dir / "diagnosis.json"
    result["diagnosis_printed"] = printed[-1] if printed else None
    result["summary_line"] = next((line for line in result["script_lines"] if line.startswith("gradsync run:")), None)
    if not path.exists():
        result["diagnosis"] = None
        return result
    data = json.loads(path.read_text())
    result["diagnosis"] = {"status": data.get("status"), "trigger": data.get("trigger"),
                           "findings": data.get("findings", []), "ranks": data.get("ranks", {})}
    return result


def run_framework(key: str, args, bin_dir: Path, work: Path) -> dict:
    name, dist, script = SCRIPTS[key]
    torchrun = [str(bin_dir / "torchrun"), "--standalone", "--nproc-per-node", "2", str(script)]
    runs: dict[str, list] = {"torchrun": [], "gradsync": []}
    for rnd in range(args.rounds):
        order = ["torchrun", "gradsync"] if rnd % 2 == 0 else ["gradsync", "torchrun"]
        for which in order:
            tag = f"{key}-{which}-{rnd + 1}"
            if which == "torchrun":
                res = launch(torchrun, work, work / f"{tag}.log", args.limit)
            else:
                run_dir = work / "runs" / tag
                cmd = [str(bin_dir / "gradsync"), "run", "--standalone", "--nproc-per-node", "2",
                       "--run-dir", str(run_dir), str(script)]
                res = diagnosis(launch(cmd, work, work / f"{tag}.log", args.limit), run_dir)
            runs[which].append(res)
            print(f"  {tag}: rc {res['rc']}, {res['wall_s']:.1f} s, {res['final']}"
                  + (f", diagnosis {res['diagnosis']['status']} ({len(res['diagnosis']['findings'])} findings)"
                     if res.get("diagnosis") else ("" if which == "torchrun" else ", no diagnosis.json")),
                  flush=True)
    return {"framework": name, "package": dist, "version": version(bin_dir, dist), "script": script.name, **runs}


def run_broken(args, bin_dir: Path, work: Path) -> dict:
    bug_line = next(i for i, line in enumerate(BROKEN.read_text().splitlines(), 1) if "# BUG" in line)
    run_dir = work / "runs" / "broken-gradsync"
    cmd = [str(bin_dir / "gradsync"), "run", "--standalone", "--nproc-per-node", "2", "--stall-timeout", "20",
           "--run-dir", str(run_dir), str(BROKEN), "--bug", "barrier_rank0"]
    gs = diagnosis(launch(cmd, work, work / "broken-gradsync.log", args.limit), run_dir)
    print(f"  broken-gradsync: rc {gs['rc']}, {gs['wall_s']:.1f} s, {gs['summary_line']}", flush=True)
    tr = None
    if args.hang_limit > 0:
        tr = launch([str(bin_dir / "torchrun"), "--standalone", "--nproc-per-node", "2", str(BROKEN), "--bug",
                     "barrier_rank0"], work, work / "broken-torchrun.log", args.hang_limit)
        print(f"  broken-torchrun: rc {tr['rc']}, {tr['wall_s']:.1f} s, killed: {tr['killed_after_s'] is not None}",
              flush=True)
    expected = f"{BROKEN.name}:{bug_line}"
    findings = (gs.get("diagnosis") or {}).get("findings") or []
    first = findings[0] if findings else {}
    return {"expected_rank0_location": expected, "gradsync": gs, "torchrun": tr,
            "category": first.get("category"), "ranks": first.get("ranks"), "locations": first.get("locations"),
            "collective": first.get("collective"),
            "rank0_line_right": str((first.get("locations") or {}).get("0", "")).endswith(expected),
            "epoch_lines_shown": {"gradsync": sum(line.startswith("epoch ") for line in gs["script_lines"]),
                                  "torchrun": sum(line.startswith("epoch ") for line in tr["script_lines"]) if tr else None}}


def describe_findings(findings: list[dict]) -> str:
    if not findings:
        return "none"
    return "; ".join(f"{f.get('severity')} {f.get('category')} (ranks {f.get('ranks')})" for f in findings)


def table(results: list[dict], broken: dict | None) -> str:
    rows = ["| framework | version | torchrun | gradsync run | diagnosis | findings | same final line | wall time ratio (gradsync / torchrun, medians) |",
            "|---|---|---|---|---|---|---|---|"]
    for r in results:
        def rcs(runs):
            return ", ".join(f"rc {x['rc']}" for x in runs) + " (" + ", ".join(f"{x['wall_s']:.0f} s" for x in runs) + ")"
        diags = [x.get("diagnosis") for x in r["gradsync"]]
        statuses = ", ".join((d or {}).get("status", "missing") for d in diags)
        findings = sorted({describe_findings((d or {}).get("findings", [])) for d in diags})
        finals = {x["final"] for x in r["torchrun"] + r["gradsync"]}
        same = "yes" if len(finals) == 1 and None not in finals else "NO: " + " / ".join(sorted(map(str, finals)))
        ratio = statistics.median(x["wall_s"] for x in r["gradsync"]) / statistics.median(x["wall_s"] for x in r["torchrun"])
        rows.append(f"| {r['framework']} | {r['package']} {r['version']} | {rcs(r['torchrun'])} | {rcs(r['gradsync'])} "
                    f"| {statuses} | {' / '.join(findings)} | {same} | {ratio:.2f} |")
    if broken:
        gs, tr = broken["gradsync"], broken["torchrun"]
        tr_text = "not run" if tr is None else (f"hung: killed after {tr['killed_after_s']:.0f} s (rc {tr['rc']})"
                                                if tr["killed_after_s"] else f"rc {tr['rc']} ({tr['wall_s']:.0f} s)")
        d = gs.get("diagnosis") or {}
        locs = ", ".join(f"rank {k}: {Path(v).name}" for k, v in sorted((broken["locations"] or {}).items()))
        rows.append(f"| Accelerate, broken (`wait_for_everyone()` on rank 0 only) | | {tr_text} "
                    f"| rc {gs['rc']} ({gs['wall_s']:.0f} s) | {d.get('status', 'missing')} ({d.get('trigger')}) "
                    f"| {broken['category']} (ranks {broken['ranks']}), {broken['collective']}, {locs}; rank 0's line "
                    f"{'right' if broken['rank0_line_right'] else 'WRONG'} (expected {broken['expected_rank0_location']}) "
                    f"| epoch lines shown before the hang: gradsync {broken['epoch_lines_shown']['gradsync']}/3, "
                    f"torchrun {broken['epoch_lines_shown']['torchrun']}/3 | |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bin", type=Path, required=True, help="the compat venv's bin folder")
    parser.add_argument("--workdir", type=Path, required=True, help="scratch folder: logs, run dirs, results")
    parser.add_argument("--rounds", type=int, default=2, help="launches per launcher and framework (ABBA order)")
    parser.add_argument("--only", default="accelerate,lightning,hf_trainer")
    parser.add_argument("--limit", type=float, default=600, help="seconds before a launch is killed")
    parser.add_argument("--hang-limit", type=float, default=60,
                        help="seconds the broken script gets under plain torchrun (0: skip it)")
    parser.add_argument("--no-broken", action="store_true")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    bin_dir = args.bin.resolve()

    print(f"workdir {args.workdir}; torch {version(bin_dir, 'torch')}, gradsync {version(bin_dir, 'gradsync')}, "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    results = []
    for key in args.only.split(","):
        print(f"{SCRIPTS[key][0]}:", flush=True)
        results.append(run_framework(key, args, bin_dir, args.workdir))
    broken = None
    if not args.no_broken:
        print("broken Accelerate script:", flush=True)
        broken = run_broken(args, bin_dir, args.workdir)
    text = table(results, broken)
    versions = {d: version(bin_dir, d) for d in ("torch", "gradsync", "accelerate", "lightning", "transformers")}
    (args.workdir / "results.json").write_text(json.dumps({"versions": versions, "frameworks": results,
                                                           "broken": broken}, indent=1))
    (args.workdir / "table.md").write_text(text + "\n")
    print()
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    print(text)
    bad = [r["framework"] for r in results
           if any(x["rc"] != 0 or (x.get("diagnosis") or {}).get("status") != "ok"
                  or (x.get("diagnosis") or {}).get("findings") for x in r["gradsync"])]
    if bad:
        print(f"\nNOT clean under gradsync run: {', '.join(bad)} (see {args.workdir / 'results.json'})")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
