"""The zoo's stall cases under `gradsync run` and under PyTorch's own tools, side by side.

For each case (2 processes, Gloo, one case at a time):

1. `gradsync run --stall-timeout 5`: its verdict from RUN_DIR/diagnosis.json (category, the rank
   it blames, the `file:line` of each rank);
2. PyTorch's Flight Recorder analyser (`python -m torch.distributed.flight_recorder.fr_trace`,
   the `torchfrtrace` console script) on the Flight Recorder dumps of that same run
   (RUN_DIR/workers/attempt0/flight/rank_R);
3. plain torchrun with `TORCH_DISTRIBUTED_DEBUG=DETAIL`, stopped after 60 s (the whole process
   tree: torchrun starts each worker in a session of its own).

It prints one markdown table (one short cell per tool, who names the rank and the line, and
whether gradsync agrees where fr_trace names a rank) and writes it to --output. The raw
outputs stay under --work-dir.

Run with `make bench-side-by-side` or `python benchmarks/side_by_side.py [--cases a b]`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO_ROOT = Path(__file__).resolve().parent.parent
ZOO = REPO_ROOT / "tests" / "run" / "zoo"
# Zoo scripts that hang or fail because the ranks are in different places.
STALL_CASES = [
    "uneven_batches_barrier", "barrier_inside_rank0", "rank_dependent_branch", "stuck_rank", "timed_hang",
    "dataloader_worker_hang", "timeout_waiting_for_poller", "extra_scalar_all_reduce", "skipped_send",
    "subgroup_vs_default", "full_tensor_on_rank0", "bn_eval_rank0", "early_stop_alone", "continue_bad_batch",
    "batched_p2p_skipped", "compiled_collective_rank0", "init_timeout_skipped_barrier",
    "send_object_list_mismatch", "busy_thread_masks_hang",
]
SCRIPT_ARGS = {"bn_eval_rank0": ["--steps", "20"]}  # with the default 18 steps it exits 0
WORLD_SIZE = 2
STOPPED = "[side_by_side: stopped"


def run_tree(command: list[str], env: dict[str, str], timeout: float, log: Path) -> tuple[int | None, float]:
    """Runs `command` with stdout+stderr into `log`; past `timeout`, ends it and every descendant.

    Returns (exit code or None when it was stopped, wall seconds)."""
    start = time.monotonic()
    log.write_text("")
    with log.open("a") as out:  # O_APPEND: the child's writes and the stop note below never overwrite each other
        proc = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout), time.monotonic() - start
        except subprocess.TimeoutExpired:
            out.write(f"\n{STOPPED} after {timeout:.0f} s]\n")  # what follows is the stop's own noise
            out.flush()
        try:
            tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            tree = []
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in tree:
                try:
                    p.send_signal(sig)
                except psutil.NoSuchProcess:
                    pass
            _, alive = psutil.wait_procs(tree, timeout=5)
            if not alive:
                break
            tree = alive
        proc.wait()
        return None, time.monotonic() - start


def zoo_tags(case: str) -> dict[int, str]:
    lines = (ZOO / f"{case}.py").read_text().splitlines()
    return {i: m.group(1) for i, text in enumerate(lines, 1) if (m := re.search(r"# zoo: (\S+)\s*$", text))}


def short_location(location: str, tags: dict[int, str], case: str) -> str:
    """'tests/run/zoo/x.py:43' -> 'x.py:43 (barrier)', the tag when the line carries one."""
    m = re.search(r"([^\s/]+\.py):(\d+)", location)
    if not m:
        return location
    tag = tags.get(int(m.group(2))) if m.group(1) == f"{case}.py" else None
    return f"{m.group(1)}:{m.group(2)}" + (f" ({tag})" if tag else "")


def cell(text: str, limit: int = 230) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


# ---------------------------------------------------------------- gradsync run


def gradsync_verdict(run_dir: Path, case: str, rc: int | None) -> dict:
    path = run_dir / "diagnosis.json"
    if not path.exists():
        return {"text": f"no diagnosis (exit {rc})", "ranks": set(), "located": set()}
    diagnosis = json.loads(path.read_text())
    findings = diagnosis.get("findings") or []
    errors = [f for f in findings if f.get("severity") == "error"] or findings
    if not errors:
        return {"text": f"no finding (status {diagnosis.get('status')})", "ranks": set(), "located": set()}
    finding, tags = errors[0], zoo_tags(case)
    ranks = {int(r) for r in finding.get("ranks") or []}
    locations = {int(r): short_location(loc, tags, case) for r, loc in (finding.get("locations") or {}).items()}
    blamed = ", ".join(str(r) for r in sorted(ranks)) or "none"
    where = "; ".join(f"r{r} {loc}" for r, loc in sorted(locations.items())) or "no line"
    return {"text": f"**{finding.get('category')}**, blames rank {blamed}: {where}",
            "ranks": ranks, "located": set(locations)}


# ---------------------------------------------------------------- fr_trace

FR_HEADER = re.compile(
    r"^(?:Collective sequence number: (\d+) has errors"
    r"|Not all ranks joining collective, sequence number: (\d+)"
    r"|Input/output mismatch in the collective sequence number: (\d+))"
)
ERROR_TYPES = {"COLLECTIVE_TYPE_MISMATCH": "type mismatch", "SIZE_OR_SYNTAX_MISMATCH": "size mismatch",
               "COLLECTIVE_STATE_MISMATCH": "state mismatch", "COLLECTIVE_DTYPE_MISMATCH": "dtype mismatch"}


def _fr_field(block: list[str], name: str) -> str:
    return next((line.split(":", 1)[1].strip() for line in block if line.startswith(name + ":")), "")


def fr_trace_verdict(text: str, rc: int | None) -> dict:
    lines = [line.rstrip() for line in text.splitlines()]
    lines = [line for line in lines if line and "tabulate is not installed" not in line]
    starts = [i for i, line in enumerate(lines) if FR_HEADER.match(line)]
    if starts:
        end = starts[1] if len(starts) > 1 else len(lines)
        block = lines[starts[0]:end]
        seq = next(g for g in FR_HEADER.match(block[0]).groups() if g)
        op = _fr_field(block, "collective").removeprefix("gloo:").removeprefix("nccl:")
        name, _, desc = _fr_field(block, "group info").partition(":")
        group = desc or f"group {name}"
        ranks: set[int] = set()
        parts = []
        missing = _fr_field(block, "missing ranks")
        if missing:
            ranks |= {int(r) for r in re.findall(r"\d+", missing)}
            parts.append(f"rank {', '.join(str(r) for r in sorted(ranks))} missing")
        for piece in _fr_field(block, "error msg").split("Culprit rank ")[1:]:
            m = re.match(r"(\d+); Error type: (\w+)(?:, (.*))?", piece.strip().rstrip(","))
            if not m:
                continue
            ranks.add(int(m.group(1)))
            detail = m.group(3) or ""
            found = re.search(r"Expected [\w ]*?(?:type|sizes|dtypes|state): '(.*?)' does not match found .*?: '(.*?)'",
                              detail)
            detail = f"expected {found.group(1)}, found {found.group(2)}" if found else cell(detail, 60)
            parts.append(f"culprit rank {m.group(1)}, {ERROR_TYPES.get(m.group(2), m.group(2))}"
                         + (f" ({detail})" if detail else ""))
        if not parts and block[0].startswith("Input/output"):
            parts.append("input/output sizes differ")
        trace = next((i for i, line in enumerate(block) if line.startswith("collective stack trace:")), len(block))
        located = any(re.search(r" at \S+:\d+", line) for line in block[trace:])
        more = f" (+{len(starts) - 1} more)" if len(starts) > 1 else ""
        return {"text": f"#{seq} {op} on {group}: {'; '.join(parts)}{more}", "ranks": ranks, "line": located}
    if rc not in (0, None) or any(line.startswith("Traceback") for line in lines):
        last = next((line for line in reversed(lines) if re.match(r"^\w[\w.]*(Error|Exception)\b", line)),
                    lines[-1] if lines else f"exit {rc}")
        return {"text": f"crashed: {cell(last, 120)}", "ranks": set(), "line": False}
    for line in lines:
        if line.startswith("We cannot decide"):
            missing = re.search(r"ranks \((.*?)\)", line)
            return {"text": f"cannot decide: no dumps from ranks {missing.group(1) if missing else '?'}",
                    "ranks": set(), "line": False}
        if line.startswith("No errors found for this collective entry"):
            return {"text": "no mismatch found (\"other reasons\" for the timeout)", "ranks": set(), "line": False}
        if "has an empty op list" in line:
            return {"text": cell(line, 120), "ranks": set(), "line": False}
    return {"text": "no mismatch found (prints nothing)", "ranks": set(), "line": False}


# ---------------------------------------------------------------- TORCH_DISTRIBUTED_DEBUG=DETAIL


def _script_line(lines: list[str], case: str, tags: dict[int, str]) -> str | None:
    """The innermost frame of the case's own script in the first traceback: 'r0 x.py:N (tag)'."""
    found = None
    for line in lines:
        m = re.search(rf'^(?:\[rank(\d+)\]:)?\s*File "[^"]*/{re.escape(case)}\.py", line (\d+)', line)
        if m:
            found = (f"r{m.group(1)} " if m.group(1) else "") + short_location(f"{case}.py:{m.group(2)}", tags, case)
        elif found and re.search(r"(Error|Exception)\b.*:", line):
            break
    return found


def detail_verdict(text: str, rc: int | None, case: str, timeout: float) -> dict:
    text = text.split(STOPPED, 1)[0]
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    tags = zoo_tags(case)
    mismatch = next((line for line in lines if "Detected mismatch between collectives" in line), None)
    if mismatch:
        running = re.findall(r"Rank (\d+) is running collective: CollectiveFingerPrint\(([^)]*)\)", mismatch)
        sides = []
        for rank, fingerprint in running:
            op = re.search(r"OpType=(\w+)", fingerprint)
            seq = re.search(r"SequenceNumber=(\d+)", fingerprint)
            sides.append(f"rank {rank} {op.group(1) if op else '?'}" + (f" #{seq.group(1)}" if seq else ""))
        where = _script_line(lines, case, tags)
        return {"text": "collective mismatch: " + (" vs ".join(sides) or cell(mismatch, 100))
                        + (f" at {where}" if where else ""),
                "ranks": {int(r) for r, _ in running}, "line": bool(where)}
    monitored = next((line for line in lines if "failed to pass monitoredBarrier" in line), None)
    if monitored:
        ranks = re.search(r"Ranks? ([\d, ]+) failed", monitored)
        where = _script_line(lines, case, tags)
        return {"text": cell(monitored.rsplit("]:", 1)[-1], 100) + (f"; traceback at {where}" if where else ""),
                "ranks": {int(r) for r in re.findall(r"\d+", ranks.group(1))} if ranks else set(), "line": bool(where)}
    signals = sorted(set(re.findall(r"exitcode\s*:\s*(-\d+)\s*\(pid: \d+\)\s*\((SIG\w+)\)", text)))
    segv = [s for s in signals if s[1] == "SIGSEGV"]
    if segv:
        ranks = sorted({int(r) for r in re.findall(r"rank\s*:\s*(\d+) \(local_rank[^\n]*\n\s*exitcode\s*:\s*-11\b", text)})
        return {"text": f"crashed: SIGSEGV on rank{'s' if len(ranks) != 1 else ''} {', '.join(map(str, ranks)) or '?'}",
                "ranks": set(), "line": False}
    error = next((line for line in lines if re.match(r"^(\[rank\d+\]:\s*)?\w[\w.]*(Error|Exception)\b: ", line)
                  and "ChildFailedError" not in line), None)
    if error:
        rank = re.match(r"\[rank(\d+)\]", error)
        where = _script_line(lines, case, tags)
        message = re.sub(r"^\[rank\d+\]:\s*", "", error)
        return {"text": f"rank {rank.group(1) if rank else '?'} raised: {cell(message, 110)}"
                        + (f" at {where}" if where else ""),
                "ranks": set(), "line": bool(where)}
    if rc is None:
        return {"text": f"nothing; hangs (stopped at {timeout:.0f} s)", "ranks": set(), "line": False}
    return {"text": f"exit {rc}, no error", "ranks": set(), "line": False}


# ---------------------------------------------------------------- the table


def agreement(gradsync: dict, fr: dict) -> str:
    if not fr["ranks"]:
        return "n/a (fr_trace names no rank)"
    named = ", ".join(map(str, sorted(fr["ranks"])))
    if fr["ranks"] <= gradsync["ranks"]:
        return f"yes: same rank ({named})"
    if set(range(WORLD_SIZE)) <= gradsync["located"]:
        return f"yes: both ranks named (fr_trace: {named})"
    return f"**NO**: fr_trace blames {named}, gradsync {', '.join(map(str, sorted(gradsync['ranks']))) or 'none'}"


def names(verdict: dict) -> str:
    rank = "rank" if verdict["ranks"] else ""
    line = "line" if verdict.get("line") or verdict.get("located") else ""
    return " + ".join(x for x in (rank, line) if x) or "neither"


def run_case(case: str, work_dir: Path, args: argparse.Namespace) -> None:
    """Runs the three tools on one case; their raw outputs, exit codes and times go under work_dir/case."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TORCH_DISTRIBUTED_DEBUG", None)
    script = [f"tests/run/zoo/{case}.py", *SCRIPT_ARGS.get(case, [])]
    case_dir = work_dir / case
    if case_dir.exists():
        shutil.rmtree(case_dir)
    case_dir.mkdir(parents=True)
    run_dir = case_dir / "run"
    meta: dict = {"rc": {}, "seconds": {}}

    meta["rc"]["gradsync"], meta["seconds"]["gradsync"] = run_tree(
        [sys.executable, "-m", "gradsync", "run", "--standalone", "--nproc-per-node", str(WORLD_SIZE),
         "--stall-timeout", str(args.stall_timeout), "--run-dir", str(run_dir), *script],
        env, args.gradsync_timeout, case_dir / "gradsync.txt")

    flight = run_dir / "workers" / "attempt0" / "flight"
    if any(flight.glob("rank_*")):
        command = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(flight), "-p", "rank_"]
        meta["rc"]["fr_trace"], meta["seconds"]["fr_trace"] = run_tree(command, env, 120, case_dir / "fr_trace.txt")
        if "Missing dump files from ranks" in (case_dir / "fr_trace.txt").read_text(errors="replace"):
            # it refuses to analyse without every rank's dump; its best effort, as the flag asks
            meta["rc"]["fr_trace_incomplete"], _ = run_tree(
                [*command, "--allow-incomplete-ranks"], env, 120, case_dir / "fr_trace_incomplete.txt")

    meta["rc"]["detail"], meta["seconds"]["detail"] = run_tree(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD_SIZE), *script],
        {**env, "TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, args.detail_timeout, case_dir / "detail.txt")
    (case_dir / "meta.json").write_text(json.dumps(meta))


def empty_pg_config(flight: Path) -> list[int]:
    """Ranks whose dump has no process group in pg_config (fr_trace cannot place their entries)."""
    import pickle

    empty = []
    for dump in sorted(flight.glob("rank_*")):
        try:
            if not pickle.loads(dump.read_bytes()).get("pg_config"):
                empty.append(int(dump.name.removeprefix("rank_")))
        except Exception:  # an unreadable dump is fr_trace's to report
            pass
    return empty


def summarise_case(case: str, work_dir: Path, args: argparse.Namespace) -> dict:
    case_dir = work_dir / case
    meta = json.loads((case_dir / "meta.json").read_text())
    rc = meta["rc"]
    gradsync = gradsync_verdict(case_dir / "run", case, rc["gradsync"])

    flight = case_dir / "run" / "workers" / "attempt0" / "flight"
    if "fr_trace" not in rc:
        fr = {"text": "no dumps", "ranks": set(), "line": False}
    else:
        text = (case_dir / "fr_trace.txt").read_text(errors="replace")
        fr = fr_trace_verdict(text, rc["fr_trace"])
        if missing := re.search(r"Missing dump files from ranks (\{[\d, ]*\})", text):
            partial = fr_trace_verdict((case_dir / "fr_trace_incomplete.txt").read_text(errors="replace"),
                                       rc.get("fr_trace_incomplete"))
            fr = {**partial, "text": f"refuses: no dump from rank {missing.group(1)[1:-1]}; with "
                                     f"--allow-incomplete-ranks: {partial['text']}"}
        elif fr["text"].startswith("crashed") and (empty := empty_pg_config(flight)):
            fr["text"] += f" (rank {', '.join(map(str, empty))}'s dump has an empty pg_config)"

    detail = detail_verdict((case_dir / "detail.txt").read_text(errors="replace"), rc["detail"], case,
                            args.detail_timeout)
    return {"case": case, "gradsync": gradsync, "fr_trace": fr, "detail": detail, "seconds": meta["seconds"]}


def table(rows: list[dict]) -> str:
    out = ["| case | gradsync run | fr_trace on the same run's dumps | TORCH_DISTRIBUTED_DEBUG=DETAIL "
           "| names rank / line (gradsync; fr_trace; DETAIL) | gradsync right where fr_trace names a rank |",
           "|---|---|---|---|---|---|"]
    for row in rows:
        g, f, d = row["gradsync"], row["fr_trace"], row["detail"]
        out.append(f"| `{row['case']}` | {cell(g['text'])} | {cell(f['text'])} | {cell(d['text'])} "
                   f"| {names(g)}; {names(f)}; {names(d)} | {agreement(g, f)} |")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="*", help="zoo scripts to run (default: every stall case present)")
    parser.add_argument("--output", type=Path, help="write the markdown table here too")
    parser.add_argument("--work-dir", type=Path, default=REPO_ROOT / "gradsync_runs" / "side-by-side")
    parser.add_argument("--stall-timeout", type=float, default=5)
    parser.add_argument("--detail-timeout", type=float, default=60)
    parser.add_argument("--summarise-only", action="store_true",
                        help="rebuild the table from the raw outputs already in --work-dir, running nothing")
    parser.add_argument("--gradsync-timeout", type=float, default=240, help="a guard; a hang is stopped sooner")
    args = parser.parse_args()

    cases = args.cases or [c for c in STALL_CASES if (ZOO / f"{c}.py").exists()]
    missing = [c for c in cases if not (ZOO / f"{c}.py").exists()]
    if missing:
        parser.error(f"no such zoo script: {', '.join(missing)}")
    start = time.monotonic()
    if not args.summarise_only:
        for case in cases:  # one at a time: the machine may have only 2 cores
            run_case(case, args.work_dir, args)
            seconds = json.loads((args.work_dir / case / "meta.json").read_text())["seconds"]
            print(f"{case}: " + ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items()), file=sys.stderr, flush=True)
    rows = [summarise_case(case, args.work_dir, args) for case in cases]
    result = table(rows)
    wall = time.monotonic() - start
    print(result)
    ran = "" if args.summarise_only else f" in {wall:.0f} s"
    print(f"{len(rows)} cases{ran}; raw outputs under {args.work_dir}", file=sys.stderr)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(result)
    (args.work_dir / "side_by_side.json").write_text(json.dumps(
        [{**r, **{k: {**r[k], "ranks": sorted(r[k]["ranks"]),
                      **({"located": sorted(r[k]["located"])} if "located" in r[k] else {})}
                  for k in ("gradsync", "fr_trace", "detail")}} for r in rows], indent=1))


if __name__ == "__main__":
    main()
