"""`make gpu-check`: every CUDA path of gradsync exercised once on one GPU, in under 8 minutes.

Each check below is one small function. It runs gradsync (its CLI, or this file's own workers
under a launcher) in a subprocess with a timeout, so a hang or a crash in one check leaves the
others running, and reads what the run left behind: the demo's printed accuracy, metrics.jsonl,
diagnosis.json, Flight Recorder dumps, profiler traces. The table (path | ok/failed/skipped |
what it measured) is printed and written as markdown to --output; a failed row carries the last
lines of the failing command's output, whose full log lies next to the table. The exit code is
1 when a check failed.

One GPU limits what can run: NCCL needs one GPU per rank, so NCCL runs at world size 1 (where
gradsync wraps no DDP and reduces nothing), and the checks that need two ranks run them on Gloo
with both ranks' tensors on cuda:0. Without CUDA the script says so in one line and exits 0.

Run with `make gpu-check` or `python benchmarks/gpu_check.py [--output PATH] [--only WORDS]` (`--only
compression` reruns the checks whose path holds those words).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Callable

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = Path("gradsync_runs/gpu_check/table.md")
BUDGET_S = 470.0  # all checks together, so the whole script stays under 8 minutes with its start
TAIL_LINES = 4  # of a failing command's output, in its table row
DEMO_MIN_ACCURACY = 0.95
# FSDP2 and TP rows train the demo for fewer epochs: they check the strategy runs on CUDA and learns.
SHARDED_DEMO_EPOCHS = 6
SHARDED_MIN_ACCURACY = 0.90
ACCUMULATION = 4
PROFILED_STEPS = (4, 6)

# name, bound on the first step's relative error, on that of the 30-step sum, least compression
# ratio: the bounds tests/comm/test_compression.py holds on CPU, and PowerSGD from step 0 too.
COMPRESSORS = [
    ("fp16", {}, 1e-3, 1e-3, 1.9),
    ("bf16", {}, 1e-2, 1e-2, 1.9),
    ("int8", {}, 0.05, 0.01, 3.0),
    ("topk", {"topk_ratio": 0.1}, 1.0, 0.15, 2.0),
    ("powersgd", {"powersgd_start_step": 3}, 1.0, 0.1, 1.2),
    ("powersgd", {"powersgd_start_step": 0}, 1.0, 0.1, 1.2),
]


# -- results and the table --------------------------------------------------------------------


@dataclass(frozen=True)
class Result:
    path: str
    status: str  # "ok", "failed" or "skipped"
    measured: str


class CheckFailed(Exception):
    """What went wrong, as it goes in the table."""


class CheckSkipped(Exception):
    """Why the check could not run here, as it goes in the table."""


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def markdown_table(results: list[Result], title: str) -> str:
    lines = [f"# {title}", "", "| path | result | what it measured |", "|---|---|---|"]
    lines += [f"| {_cell(r.path)} | {r.status} | {_cell(r.measured)} |" for r in results]
    return "\n".join(lines) + "\n"


def console_table(results: list[Result]) -> str:
    width = max([len("path")] + [len(r.path) for r in results])
    lines = [f"{'path':<{width}}  {'result':<7}  what it measured"]
    lines += [f"{r.path:<{width}}  {r.status:<7}  {' '.join(r.measured.split())}" for r in results]
    return "\n".join(lines)


def exit_code(results: list[Result]) -> int:
    return 1 if any(r.status == "failed" for r in results) else 0


def run_check(path: str, check: Callable[[], str]) -> Result:
    try:
        return Result(path, "ok", check())
    except CheckSkipped as reason:
        return Result(path, "skipped", str(reason))
    except CheckFailed as problem:
        return Result(path, "failed", str(problem))
    except Exception as error:  # reading what a run left behind went wrong: that check failed, not the script
        return Result(path, "failed", f"{type(error).__name__}: {error}")


# -- subprocesses -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Done:
    returncode: int | None  # None: killed at its timeout
    output: str
    log: Path

    def tail(self) -> str:
        lines = [line for line in self.output.splitlines() if line.strip()]
        return " / ".join(lines[-TAIL_LINES:]) or "(no output)"

    def require_success(self, what: str) -> "Done":
        if self.returncode is None:
            raise CheckFailed(f"{what} hung: killed at its timeout; last lines: {self.tail()} (log: {self.log})")
        if self.returncode != 0:
            raise CheckFailed(f"{what} exited {self.returncode}; last lines: {self.tail()} (log: {self.log})")
        return self


class Runner:
    """Starts the checks' commands, each in its own session so a timeout kills all it started,
    within one budget for the whole script."""

    def __init__(self, work_dir: Path, budget_s: float) -> None:
        self.work_dir = work_dir
        self.deadline = time.monotonic() + budget_s

    def folder(self, name: str) -> Path:
        """A fresh folder for one run's files: an earlier gpu-check's would be read as this one's."""
        path = self.work_dir / name
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    def run(self, name: str, argv: list[str], timeout_s: float, env: dict[str, str] | None = None) -> Done:
        left = self.deadline - time.monotonic()
        if left < 10:
            raise CheckSkipped(f"not run: the {BUDGET_S:.0f} s budget of the whole check was spent")
        log = self.work_dir / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        environment = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with log.open("w") as out:
            proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, env=environment,
                                    start_new_session=True)
            try:
                code: int | None = proc.wait(timeout=min(timeout_s, left))
            except subprocess.TimeoutExpired:
                code = None
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # whatever it started and left behind
                except ProcessLookupError:
                    pass
                proc.wait()
        return Done(code, log.read_text(errors="replace"), log)


def gradsync(*args: str) -> list[str]:
    return [sys.executable, "-m", "gradsync", *args]


def torchrun(nproc: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args]


def this_worker(name: str, out: Path, *args: str) -> list[str]:
    """This file as a launcher's script, running worker `name`; rank 0 writes its result to `out`."""
    return [str(Path(__file__).resolve()), "--worker", name, "--out", str(out), *args]


def read_json_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# -- the checks ---------------------------------------------------------------------------------


class Checks:
    def __init__(self, runner: Runner) -> None:
        self.runner = runner

    def all(self) -> list[tuple[str, Callable[[], str]]]:
        return [
            ("demo --precision fp16 (NCCL, 1 rank)", lambda: self.demo_accuracy("fp16")),
            ("demo --precision bf16 (NCCL, 1 rank)", lambda: self.demo_accuracy("bf16")),
            ("accumulation: one reduction per window", self.accumulation),
            ("compression hooks on CUDA (Gloo, 2 ranks on cuda:0)", self.compression),
            ("gradsync run: healthy NCCL script, Flight Recorder", self.healthy_run),
            ("--profile-steps: breakdown of a CUDA trace (Gloo, 2 ranks on cuda:0)", self.profile_breakdown),
            ("NVML system metrics", self.nvml_metrics),
            ("gradsync doctor (1 rank)", self.doctor),
            ("bench allreduce (NCCL, 1 rank)", self.bench_allreduce),
            ("FSDP2: demo --parallel fsdp (NCCL, 1 rank)", lambda: self.sharded_demo("fsdp")),
            ("tensor parallel: demo --parallel tp (NCCL, 1 rank)", lambda: self.sharded_demo("tp")),
            ("exposed communication: end-of-backward wait vs the trace", self.exposed_vs_trace),
        ]

    # 1. The demo at each mixed precision, on the GPU.

    @cache
    def _demo(self, name: str, *options: str) -> tuple[Done, Path]:
        run_dir = self.runner.folder(name)
        argv = gradsync("demo", "--nproc-per-node", "1", "--run-dir", str(run_dir), *options)
        return self.runner.run(name, argv, timeout_s=150), run_dir

    @staticmethod
    def _accuracy(done: Done) -> float:
        match = re.search(r"test accuracy\D*?([\d.]+)%", done.output)
        if match is None:
            raise CheckFailed(f"the demo printed no test accuracy; last lines: {done.tail()}")
        return float(match.group(1)) / 100

    def demo_accuracy(self, precision: str) -> str:
        done, run_dir = self._demo(f"demo-{precision}", "--precision", precision)
        done.require_success(f"gradsync demo --precision {precision}")
        accuracy = self._accuracy(done)
        rows = read_json_lines(run_dir / "metrics.jsonl")
        skipped = sum(1 for row in rows if row.get("skipped"))
        measured = f"test accuracy {100 * accuracy:.2f}% (needs {100 * DEMO_MIN_ACCURACY:.0f}%), {len(rows)} steps, {skipped} skipped"
        if accuracy < DEMO_MIN_ACCURACY:
            raise CheckFailed(measured)
        return measured

    # 2. Accumulation: gradsync's own reduction counter, per optimizer step.

    def accumulation(self) -> str:
        # NCCL at world size 1 wraps no DDP: the windows must still close, reducing nothing.
        alone = self._accumulate("accumulation-nccl", 1, "nccl")
        # Two Gloo ranks on the one GPU: DDP's CUDA path, its no_sync and the CUDA-event timer.
        pair = self._accumulate("accumulation-gloo-cuda", 2, "gloo")
        problems = []
        for label, result, per_window in (("NCCL, 1 rank", alone, 0), ("Gloo, 2 ranks on cuda:0", pair, 1)):
            if result["steps"] != result["windows"] or any(r != per_window for r in result["reductions"]):
                problems.append(f"{label}: {result['steps']} steps for {result['windows']} windows, "
                                f"reductions per step {result['reductions']} (expected {per_window} each)")
            if result["hook_passes"] != per_window * result["windows"]:
                problems.append(f"{label}: the comm hook saw {result['hook_passes']} reduction passes")
        measured = (f"k={ACCUMULATION}: NCCL 1 rank {alone['steps']} steps, {sum(alone['reductions'])} reductions; "
                    f"Gloo 2 ranks on cuda:0 {pair['steps']} steps, {sum(pair['reductions'])} reductions, "
                    f"{pair['hook_passes']} hook passes")
        if problems:
            raise CheckFailed("; ".join(problems))
        return measured

    def _accumulate(self, name: str, nproc: int, backend: str) -> dict:
        run_dir = self.runner.folder(name)
        out = run_dir / "result.json"
        argv = gradsync("run", "--standalone", "--nproc-per-node", str(nproc), "--run-dir", str(run_dir),
                        *this_worker("accumulation", out, "--backend", backend))
        self.runner.run(name, argv, timeout_s=90).require_success(f"accumulation on {backend}, {nproc} rank(s)")
        return json.loads(out.read_text())

    # 3. Every compressor's hook on CUDA tensors.

    def compression(self) -> str:
        run_dir = self.runner.folder("compression")
        out = run_dir / "result.json"
        argv = gradsync("run", "--standalone", "--nproc-per-node", "2", "--run-dir", str(run_dir),
                        *this_worker("compression", out))
        self.runner.run("compression", argv, timeout_s=120).require_success("the compression worker")
        results = json.loads(out.read_text())
        measured, problems = [], []
        for (name, options, max_first, max_sum, min_ratio), result in zip(COMPRESSORS, results):
            label = name + (f"@{options['powersgd_start_step']}" if "powersgd_start_step" in options else "")
            if "error" in result:
                problems.append(f"{label}: {result['error']}")
                continue
            measured.append(f"{label} err {result['first_error']:.1e}/{result['sum_error']:.1e} x{result['ratio']:.1f}")
            bias_bound = 1e-6 if name == "powersgd" else 0.0
            failed = [what for what, bad in (
                ("replicas differ", not result["identical"]),
                (f"bias error {result['bias_error']:.1e}", result["bias_error"] > bias_bound),
                (f"first-step error over {max_first:g}", not result["first_error"] < max_first),
                (f"30-step sum error over {max_sum:g}", not result["sum_error"] < max_sum),
                (f"ratio under {min_ratio:g}", not result["ratio"] > min_ratio),
                ("warm-up steps not exact", not result.get("warmup_exact", True)),
            ) if bad]
            if failed:
                problems.append(f"{label}: {', '.join(failed)}")
        if problems:
            raise CheckFailed("; ".join(problems + measured))
        return "relative error first step/30-step sum, ratio: " + "; ".join(measured)

    # 4. gradsync run on a healthy NCCL script, and Flight Recorder's NCCL states.

    def healthy_run(self) -> str:
        from gradsync.rundir import RunDir

        run_dir = self.runner.folder("run-healthy-nccl")
        out = run_dir / "result.json"
        argv = gradsync("run", "--standalone", "--nproc-per-node", "1", "--run-dir", str(run_dir),
                        *this_worker("healthy_nccl", out))
        done = self.runner.run("run-healthy-nccl", argv, timeout_s=90)
        diagnosis_path = RunDir(run_dir).diagnosis
        diagnosis = json.loads(diagnosis_path.read_text()) if diagnosis_path.exists() else None
        if diagnosis is None:
            done.require_success("gradsync run")
            raise CheckFailed(f"no diagnosis.json; last lines: {done.tail()}")
        findings = [f"{f.get('severity')}: {f.get('category')}" for f in diagnosis.get("findings", [])]
        if diagnosis.get("status") != "ok" or findings:
            raise CheckFailed(f"diagnosis {diagnosis.get('status')}, findings {findings or 'none'}; last lines: {done.tail()}")
        done.require_success("gradsync run")
        compact_path = RunDir(run_dir).flight(0, 0)
        if not compact_path.exists():
            raise CheckFailed("no Flight Recorder dump (workers/attempt0/flight-rank0.json)")
        entries = json.loads(compact_path.read_text()).get("entries", [])
        states = sorted({str(e.get("backend_state")) for e in entries})
        raw = pickle.loads((RunDir(run_dir).flight_raw(0) / "rank_0").read_bytes())
        nccl = sum(1 for e in raw.get("entries", []) if str(e.get("profiling_name", "")).startswith("nccl:"))
        finished = sum(1 for e in entries if e.get("state") == "finished")
        measured = (f"diagnosis ok; Flight Recorder: {len(entries)} entries ({nccl} nccl:*), NCCL states {states}, "
                    f"{finished} read as finished")
        if not entries or nccl == 0 or "completed" not in states:
            raise CheckFailed(measured + " (expected nccl:* entries in state 'completed')")
        return measured

    # 5 and 10 share one profiled run: two Gloo ranks on cuda:0 (the trainer's DDP path, CUDA kernels).

    @cache
    def _profiled(self) -> tuple[Done, Path]:
        run_dir = self.runner.folder("profiled")
        first, last = PROFILED_STEPS
        argv = gradsync("run", "--standalone", "--nproc-per-node", "2", "--run-dir", str(run_dir),
                        "--profile-steps", f"{first}:{last}",
                        *this_worker("profiled_trainer", run_dir / "result.json", "--steps", str(last + 2)))
        return self.runner.run("profiled", argv, timeout_s=150), run_dir

    def _breakdowns(self) -> tuple[Path, list[dict]]:
        from gradsync.rundir import RunDir

        done, run_dir = self._profiled()
        done.require_success("gradsync run --profile-steps")
        paths = [RunDir(run_dir).profile_breakdown(rank) for rank in (0, 1)]
        missing = [str(p) for p in paths if not p.exists()]
        if missing:
            raise CheckFailed(f"no breakdown at {', '.join(missing)}; last lines: {done.tail()}")
        return run_dir, [json.loads(p.read_text()) for p in paths]

    def profile_breakdown(self) -> str:
        from gradsync.rundir import RunDir

        run_dir, (breakdown, _) = self._breakdowns()
        trace_path = RunDir(run_dir).profile_trace(0)
        events = json.loads(trace_path.read_text()).get("traceEvents", [])
        kernels = [e for e in events if e.get("cat") == "kernel"]
        nccl = sum(1 for e in kernels if str(e.get("name", "")).startswith("nccl"))
        mean = breakdown["mean"]
        measured = (f"{len(kernels)} CUDA kernels ({nccl} NCCL: a Gloo run has none, and one GPU cannot hold 2 NCCL "
                    f"ranks); comm source {breakdown['comm_source']}; per step forward {mean['forward_s'] * 1e3:.2f} ms, "
                    f"backward {mean['backward_s'] * 1e3:.2f} ms, comm {mean['comm_s'] * 1e3:.2f} ms "
                    f"(exposed {mean['exposed_comm_s'] * 1e3:.2f}, overlap {_share(mean['overlap_ratio'])})")
        if not kernels or len(breakdown["steps"]) != PROFILED_STEPS[1] - PROFILED_STEPS[0] + 1:
            raise CheckFailed(measured + f"; {len(breakdown['steps'])} steps broken down")
        if not (mean["backward_s"] > 0 and mean["forward_s"] > 0 and mean["comm_s"] > 0):
            raise CheckFailed(measured + " (expected forward, backward and communication all above 0)")
        return measured + "; " + _hta_comparison(trace_path)

    # 6. NVML readings in the trainer's system metrics (the bf16 demo's run).

    def nvml_metrics(self) -> str:
        try:
            import pynvml  # noqa: F401  (nvidia-ml-py, gradsync's `gpu` extra)
        except ImportError:
            raise CheckSkipped("skipped: pynvml not installed (pip install 'gradsync[gpu]')") from None
        done, run_dir = self._demo("demo-bf16", "--precision", "bf16")
        done.require_success("gradsync demo --precision bf16")
        readings = [system for row in read_json_lines(run_dir / "metrics.jsonl")
                    for system in (row.get("system") or {}).values()]
        keys = ("gpu_util_percent", "gpu_memory_mb")
        found = [r for r in readings if all(key in r for key in keys)]
        if not found:
            seen = sorted({key for r in readings for key in r})
            raise CheckFailed(f"{len(readings)} system readings, none with {', '.join(keys)} (keys seen: {seen})")
        util = max(r["gpu_util_percent"] for r in found)
        memory = max(r["gpu_memory_mb"] for r in found)
        extra = sorted({key for r in found for key in r if key.startswith("gpu_")} - set(keys))
        return f"{len(found)} intervals with GPU readings: utilisation up to {util:.0f}%, memory up to {memory:.0f} MB; also {extra}"

    # 7. gradsync doctor's GPU lines.

    def doctor(self) -> str:
        done = self.runner.run("doctor", gradsync("doctor", "--nproc-per-node", "1", "--json"), timeout_s=90)
        report = _last_json(done.output, "checks")
        if report is None:
            done.require_success("gradsync doctor")
            raise CheckFailed(f"no JSON report; last lines: {done.tail()}")
        checks = {c["name"]: c for c in report["checks"]}
        gpu_lines = ("cuda", "nccl", "gpus", "device assignment", "topology")
        missing = [name for name in gpu_lines if name not in checks]
        problems = [f"{n}: {checks[n]['verdict']} ({checks[n]['value']})" for n in gpu_lines
                    if n in checks and checks[n]["verdict"] == "problem"]
        if "cuda" in checks and "GPU" not in checks["cuda"]["value"]:
            problems.append(f"cuda: {checks['cuda']['value']}")
        if "gpus" in checks and checks["gpus"]["value"].startswith("none"):
            problems.append("gpus: none seen")
        others = [f"{c['name']}: {c['verdict']}" for c in report["checks"] if c["name"] not in gpu_lines and c["verdict"] != "ok"]
        measured = "; ".join(f"{n}: {checks[n]['value'].splitlines()[0]}" for n in ("cuda", "nccl", "gpus", "device assignment") if n in checks)
        measured += f"; status {report['status']}" + (f" (not GPU lines: {', '.join(others)})" if others else "")
        if missing or problems:
            raise CheckFailed("; ".join([f"missing lines: {', '.join(missing)}"] * bool(missing) + problems) + "; " + measured)
        return measured

    # 8. The all-reduce sweep on NCCL.

    def bench_allreduce(self) -> str:
        # `gradsync bench allreduce` asks for 2 workers; its worker module runs under any launcher.
        out = self.runner.folder("bench-allreduce") / "report.json"
        argv = torchrun(1, "-m", "gradsync.bench.allreduce", "--backend", "nccl", "--max-bytes", "64M",
                        "--iters", "20", "--output", str(out), "--quiet")
        self.runner.run("bench-allreduce", argv, timeout_s=90).require_success("the all-reduce sweep on NCCL")
        report = json.loads(out.read_text())
        results = report["results"]
        if report.get("backend") != "nccl" or not results:
            raise CheckFailed(f"backend {report.get('backend')}, {len(results)} sizes measured")
        bad = [r["bytes"] for r in results if not (r["busbw_gbps"] > 0 and math.isfinite(r["busbw_gbps"]))]
        if bad:
            raise CheckFailed(f"busbw not a positive number at sizes {bad}")
        largest = results[-1]
        return (f"{len(results)} sizes up to {largest['bytes'] >> 20} MiB: busbw {largest['busbw_gbps']:.1f} GB/s, "
                f"{largest['time_s'] * 1e6:.1f} us (1 rank: NCCL moves no data, so this is the call's cost, not a link)")

    # 9. FSDP2 and tensor parallelism on CUDA, through the demo.

    def sharded_demo(self, strategy: str) -> str:
        done, run_dir = self._demo(f"demo-{strategy}", "--parallel", strategy, "--epochs", str(SHARDED_DEMO_EPOCHS),
                                   "--profile-steps", "none")
        done.require_success(f"gradsync demo --parallel {strategy}")
        accuracy = self._accuracy(done)
        rows = read_json_lines(run_dir / "metrics.jsonl")
        measured = (f"{len(rows)} steps in {SHARDED_DEMO_EPOCHS} epochs, test accuracy {100 * accuracy:.2f}% "
                    f"(needs {100 * SHARDED_MIN_ACCURACY:.0f}%)")
        if accuracy < SHARDED_MIN_ACCURACY:
            raise CheckFailed(measured)
        return measured

    # 10. gradsync's exposed communication (CUDA events around the end of backward) vs the trace's.

    def exposed_vs_trace(self) -> str:
        run_dir, breakdowns = self._breakdowns()
        rows = {row["step"]: row for row in read_json_lines(run_dir / "metrics.jsonl")}
        first, last = PROFILED_STEPS
        pairs = []
        for step in range(first, last + 1):
            traced = [s["exposed_comm_s"] for b in breakdowns for s in b["steps"] if s["step"] == step]
            if step not in rows or len(traced) != len(breakdowns):
                raise CheckFailed(f"step {step}: metrics row {'found' if step in rows else 'missing'}, "
                                  f"{len(traced)} of {len(breakdowns)} ranks' breakdowns have it")
            pairs.append((step, rows[step]["exposed_comm_s"], sum(traced) / len(traced), rows[step]["step_time_s"]))
        if any(metric < 0 or not math.isfinite(metric) for _, metric, _, _ in pairs):
            raise CheckFailed(f"a negative or non-finite exposed time: {pairs}")
        return "mean of 2 ranks, metric vs trace: " + "; ".join(
            f"step {step} {metric * 1e3:.2f} vs {traced * 1e3:.2f} ms (step {total * 1e3:.1f} ms)"
            for step, metric, traced, total in pairs)


def _share(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{100 * ratio:.0f}%"


def _last_json(output: str, key: str) -> dict | None:
    for line in reversed(output.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                data = json.loads(line)
            except json.JSONDecodeError:
                continue
            if key in data:
                return data
    return None


def _hta_comparison(trace_path: Path) -> str:
    """HTA's numbers on the same trace, as tests/profiling/test_hta_comparison.py reads them. HTA
    counts NCCL kernels as communication, so on this Gloo trace its overlap has nothing to measure."""
    try:
        from hta.trace_analysis import TraceAnalysis
    except ImportError:
        return "HTA not installed: no comparison"
    try:
        analysis = TraceAnalysis(trace_files={0: str(trace_path)}, trace_dir=str(trace_path.parent))
        overlap = analysis.get_comm_comp_overlap(visualize=False)["comp_comm_overlap_pctg"].iloc[0]
        temporal = analysis.get_temporal_breakdown(visualize=False).iloc[0]
        return (f"HTA: compute {temporal['compute_time(us)'] / 1e3:.1f} ms, non-compute "
                f"{temporal['non_compute_time(us)'] / 1e3:.1f} ms, idle {temporal['idle_time(us)'] / 1e3:.1f} ms, "
                f"comm/compute overlap {overlap:.1f}%")
    except Exception as error:  # HTA's own failure on a real trace is a finding to report, not a crash
        return f"HTA failed on the trace: {type(error).__name__}: {error}"


# -- the workers, run by a launcher as this file's script ---------------------------------------


def _worker_accumulation(args: argparse.Namespace) -> dict | None:
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.utils.data import TensorDataset

    import gradsync

    os.environ["LOCAL_RANK"] = "0"  # every rank on the one GPU (Gloo allows it, NCCL runs only 1 rank)
    hook_passes = 0

    def counting_hook(state, bucket):
        nonlocal hook_passes
        hook_passes += bucket.is_last()
        return default_hooks.allreduce_hook(state, bucket)

    trainer = gradsync.setup(accumulation_steps=ACCUMULATION, seed=0, device="cuda", backend=args.backend,
                             ddp={"comm_hook": counting_hook}, metrics={"log_every": 1, "tensorboard": False})
    generator = torch.Generator().manual_seed(0)
    per_rank, batch = 64, 4  # 16 batches a rank: 4 windows an epoch
    dataset = TensorDataset(torch.randn(per_rank * trainer.world_size, 32, generator=generator),
                            torch.randn(per_rank * trainer.world_size, 1, generator=generator))
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).to(trainer.device)
    model, optimizer, loader = trainer.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01), dataset,
                                               batch_size=batch)
    epochs = 2
    for _ in trainer.epochs(epochs):
        for x, y in loader:
            with trainer.step() as step:
                step.backward(F.mse_loss(model(x), y))
    windows = epochs * math.ceil(len(loader) / ACCUMULATION)
    summary = trainer.summary()
    trainer.close()
    if not trainer.is_main:
        return None
    rows = read_json_lines(Path(trainer.run_dir) / "metrics.jsonl")
    return {"steps": summary["steps"], "windows": windows, "reductions": [row["reductions"] for row in rows],
            "hook_passes": hook_passes}


def _trace_compressor(name: str, options: dict, device: torch.device) -> dict:
    """Known gradients through the hook on CUDA: tests/comm/test_compression.py's own tracer."""
    from tests.comm.test_compression import follow_compressor

    from gradsync.comm import CompressionConfig, make_hook

    hook = make_hook(CompressionConfig(name=name, **options))
    result = follow_compressor(hook, device, plain_steps=options.get("powersgd_start_step", 0) if name == "powersgd" else 0)
    torch.cuda.synchronize(device)
    return result


def _worker_compression(args: argparse.Namespace) -> list[dict] | None:
    import torch.distributed as dist

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("gloo")
    sys.path.insert(0, str(REPO_ROOT))  # the tracer lives in tests/, beside the CPU bounds it shares
    results = []
    for name, options, *_ in COMPRESSORS:
        try:
            results.append(_trace_compressor(name, options, device))
        except Exception as error:  # one compressor's failure is its row's, the others still run
            results.append({"error": f"{type(error).__name__}: {error}"})
    # The group is left to gradsync run's os._exit: destroyed while the last DDP model holds it,
    # it can deadlock Gloo's threads (tests/comm/test_compression.py says why).
    return results if dist.get_rank() == 0 else None


def _worker_healthy_nccl(args: argparse.Namespace) -> dict | None:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("nccl")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                                        torch.nn.Linear(64, 1)).to(device), device_ids=[device.index])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(20):
        x, y = torch.randn(16, 32, device=device), torch.randn(16, 1, device=device)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    metric = torch.ones(2, device=device)
    dist.all_reduce(metric)
    dist.barrier()
    torch.cuda.synchronize(device)
    dist.destroy_process_group()
    return {"metric": metric.tolist()}


def _worker_profiled_trainer(args: argparse.Namespace) -> dict | None:
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    import gradsync

    os.environ["LOCAL_RANK"] = "0"  # both Gloo ranks on the one GPU
    trainer = gradsync.setup(seed=0, device="cuda", backend="gloo", metrics={"log_every": 1, "tensorboard": False})
    width, batch = 1024, 64
    generator = torch.Generator().manual_seed(0)
    samples = args.steps * batch * trainer.world_size
    dataset = TensorDataset(torch.randn(samples, width, generator=generator), torch.randn(samples, 1, generator=generator))
    layers = [module for _ in range(4) for module in (torch.nn.Linear(width, width), torch.nn.ReLU())]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1)).to(trainer.device)
    model, optimizer, loader = trainer.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-3), dataset,
                                               batch_size=batch)
    for _ in trainer.epochs(1):
        for x, y in loader:
            with trainer.step() as step:
                step.backward(F.mse_loss(model(x), y))
    summary = trainer.summary()
    trainer.close()
    return {"steps": summary["steps"]} if trainer.is_main else None


WORKERS = {
    "accumulation": _worker_accumulation,
    "compression": _worker_compression,
    "healthy_nccl": _worker_healthy_nccl,
    "profiled_trainer": _worker_profiled_trainer,
}


def worker_main(args: argparse.Namespace) -> int:
    """A worker ends by returning, not through gradsync.distributed.end_process: `gradsync run`
    ends the process itself once the script's SystemExit reaches it, after writing the rank's exit
    record and its last Flight Recorder dump, which an os._exit in the script would skip."""
    result = WORKERS[args.worker](args)
    if result is not None:
        Path(args.out).write_text(json.dumps(result))
    return 0


# -- main ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help=f"markdown table (default {DEFAULT_OUTPUT})")
    parser.add_argument("--only", action="append", default=[], metavar="WORDS",
                        help="run only the checks whose path contains WORDS (repeatable), e.g. --only compression")
    parser.add_argument("--worker", choices=tuple(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--backend", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=8, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        return worker_main(args)
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device (torch.cuda.is_available() is False); nothing to check on this machine")
        return 0
    name = torch.cuda.get_device_name(0)
    title = f"gpu-check on {name} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    print(title, flush=True)
    started = time.monotonic()
    checks = Checks(Runner(args.output.parent, BUDGET_S))
    chosen = [(path, check) for path, check in checks.all() if not args.only or any(words in path for words in args.only)]
    if not chosen:
        parser.error(f"--only {' '.join(args.only)} matches no check")
    results = []
    for path, check in chosen:
        result = run_check(path, check)
        print(f"  {result.status:<7} {path}", flush=True)
        results.append(result)
    elapsed = time.monotonic() - started
    print(console_table(results))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(markdown_table(results, title) + f"\n{elapsed:.0f} s in all; logs beside this file.\n")
    print(f"gpu-check: {sum(r.status == 'ok' for r in results)} ok, {sum(r.status == 'failed' for r in results)} "
          f"failed, {sum(r.status == 'skipped' for r in results)} skipped in {elapsed:.0f} s; table: {args.output}")
    return exit_code(results)


if __name__ == "__main__":
    sys.exit(main())
