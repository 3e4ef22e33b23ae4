"""`make slurm-check`: deploy/slurm/train.sbatch on a real Slurm cluster of two simulated hosts.

The recipe runs as a user would run it, with only the values it tells users to edit changed
(`edit_recipe`): the GPUs and cores per node, the time limit, CKPT_DIR and the script. The job is
benchmarks/chaos_job.py (the digits CNN under gradsync's trainer, checkpointing every 4 steps),
so every way of stopping and resuming it can be compared bitwise with an uninterrupted run.

The behaviours checked, each a job of its own:

- healthy: the job completes; each node's run folder and the checkpoint are where the recipe says;
- broken: a rank-dependent collective; both nodes' launchers print the job-wide diagnosis;
- scancel --signal=TERM, then `scontrol requeue`: the trainer writes a final checkpoint, the
  requeued job (SLURM_RESTART_COUNT=1, its own run folder) resumes from it and ends bitwise equal;
- the time limit's notice (`--signal=TERM@120`), then the same script submitted again: the same;
- a node's workers SIGKILLed mid-job: every node restarts its workers (`--max-restarts`), resumes
  from the last checkpoint and ends bitwise equal;
- the doctor on the allocation: its Slurm checks, healthy and with each mistake they look for.

Needs root (network namespaces, the daemons); installs Slurm's Debian packages when missing.
Everything lives under --output and in the namespaces, and is stopped and deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psutil

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.slurm_cluster import SlurmCluster, SlurmError, SlurmSpec, install_packages, missing_packages  # noqa: E402

RECIPE = REPO_ROOT / "deploy" / "slurm" / "train.sbatch"
JOB = REPO_ROOT / "benchmarks" / "chaos_job.py"
BROKEN = REPO_ROOT / "tests" / "run" / "zoo" / "metric_allreduce_rank0.py"
EVERY = 4  # the job's optimizer steps between checkpoints
EPOCHS = 3
# A job of this check ends within this (a healthy one in ~30 s on 2 cores; the broken one runs
# its 4 attempts of --max-restarts 3).
JOB_TIMEOUT_S = 300.0
# --time for the time-limit trial: the notice is due 120 s before the end (--signal=TERM@120), and
# Slurm may send it up to 60 s earlier, so 60-120 s after the start: after the job's start-up
# (~10 s) whatever slurmctld's timing. (With 3 minutes it came after ~40 s here, but could come at once.)
NOTICE_TIME_LIMIT = "00:04:00"
# Each step then sleeps so long that the job is still training when the notice arrives: 36 steps
# take 144 s and more.
NOTICE_STEP_PAUSE_S = 4.0

_SHA = re.compile(r"params sha256: ([0-9a-f]{64})")
_RESUMED = re.compile(r"resuming from \S+ \(step (\d+)\)")
_COMMITTED = re.compile(r"checkpoint of step (\d+) committed")


class RecipeChanged(RuntimeError):
    """The recipe no longer has a line this check edits (the message names it)."""


# -- the recipe, as a user edits it --------------------------------------------------------------


def edit_recipe(text: str, values: Mapping[str, str]) -> str:
    """The recipe with the values a user edits replaced; nothing else changes.

    values: `gpus-per-node`, `cpus-per-task`, `time` (the #SBATCH lines), `ckpt_dir` (CKPT_DIR's
    value) and `script` (what replaces `train.py` and its arguments on the launch line).
    """
    edits: dict[str, Callable[[re.Match[str]], str]] = {
        **{rf"^#SBATCH --{name}=.*$": (lambda m, name=name: f"#SBATCH --{name}={values[name]}")
           for name in ("gpus-per-node", "cpus-per-task", "time")},
        r"^CKPT_DIR=.*$": lambda m: f"CKPT_DIR={values['ckpt_dir']}",
        r'^(\s+)train\.py --checkpoint-dir "\$CKPT_DIR" --resume auto$': lambda m: m.group(1) + values["script"],
    }
    for pattern, replacement in edits.items():
        text, count = re.subn(pattern, replacement, text, flags=re.MULTILINE)
        if count != 1:
            raise RecipeChanged(f"the recipe has {count} lines matching {pattern!r}, not one: update edit_recipe")
    return text


def job_script(progress: str, pause_s: float = 0.0) -> str:
    """chaos_job.py's launch line in the recipe's place of `train.py ...`."""
    pause = f" --step-pause-s {pause_s:g}" if pause_s else ""
    return (f'{JOB} --epochs {EPOCHS} --every {EVERY} --progress {progress}{pause} '
            f'--checkpoint-dir "$CKPT_DIR" --resume auto')


# -- the trials ----------------------------------------------------------------------------------


@dataclass
class Outcome:
    name: str
    passed: bool = False
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


class Trials:
    """The behaviours, on one Slurm cluster; each trial works in a folder of its own."""

    def __init__(self, slurm: SlurmCluster, work: Path) -> None:
        self.slurm = slurm
        self.work = work
        self.reference_sha: str | None = None

    # -- helpers --

    def env(self) -> dict[str, str]:
        """What the jobs inherit from sbatch: this venv's gradsync on PATH, no interface pinning
        (on a cluster each node finds its own address from its hostname)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("GLOO_", "NCCL_", "MASTER_", "SLURM_"))}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env["OMP_NUM_THREADS"] = "1"
        return env

    def prepare(self, name: str, script: str, time_limit: str = "00:10:00") -> tuple[Path, Path]:
        """A submission folder with the edited recipe; returns it and the job's checkpoint folder."""
        folder = self.work / name
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        ckpt = folder / "ckpt"
        values = {"gpus-per-node": str(self.slurm.spec.gpus_per_node), "cpus-per-task": str(self.slurm.spec.cpus_per_node),
                  "time": time_limit, "ckpt_dir": str(ckpt), "script": script}
        (folder / "train.sbatch").write_text(edit_recipe(RECIPE.read_text(), values))
        return folder, ckpt

    def submit(self, folder: Path) -> str:
        return self.slurm.submit(folder / "train.sbatch", cwd=folder, env=self.env())

    @staticmethod
    def output(folder: Path, job: str) -> str:
        path = folder / f"slurm-{job}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    @staticmethod
    def progress(path: Path) -> int:
        try:
            return int(path.read_text() or 0)
        except (OSError, ValueError):
            return 0

    def wait_progress(self, path: Path, step: int, job: str, timeout_s: float = JOB_TIMEOUT_S) -> int:
        deadline = time.monotonic() + timeout_s
        while (reached := self.progress(path)) < step:
            state = self.slurm.job(job).get("JobState")
            if state not in ("PENDING", "RUNNING", "CONFIGURING"):
                raise SlurmError(f"job {job} is {state} before step {step} (reached {reached})")
            if time.monotonic() > deadline:
                raise SlurmError(f"job {job} did not reach step {step} in {timeout_s:.0f} s (reached {reached})")
            time.sleep(0.1)
        return reached

    def sha(self, text: str) -> str | None:
        found = _SHA.findall(text)
        return found[-1] if found else None

    # -- behaviours --

    def healthy(self, outcome: Outcome) -> None:
        folder, ckpt = self.prepare("healthy", job_script("progress"))
        job = self.submit(folder)
        fields = self.slurm.wait(job, JOB_TIMEOUT_S)
        text = self.output(folder, job)
        self.reference_sha = self.sha(text)
        run_dirs = [folder / "gradsync_runs" / f"{job}.0" / name for name in self.slurm.names]
        committed = sorted(int(m.parent.name.removeprefix("step-")) for m in ckpt.glob("step-*/manifest.json"))
        outcome.notes.append(f"job {job} {fields['JobState']} (exit {fields.get('ExitCode')}); "
                             f"checkpoints committed at steps {committed}")
        outcome.passed = _all(outcome, {
            "the job completed": fields["JobState"] == "COMPLETED",
            "the final parameters were printed": self.reference_sha is not None,
            "each node has its run folder gradsync_runs/<job>.0/<node>/ with a diagnosis":
                all((d / "diagnosis.json").exists() for d in run_dirs),
            "the checkpoint is in CKPT_DIR": bool(committed),
        })

    def broken(self, outcome: Outcome) -> None:
        folder, _ = self.prepare("broken", str(BROKEN))
        job = self.submit(folder)
        fields = self.slurm.wait(job, JOB_TIMEOUT_S)
        text = self.output(folder, job)
        diagnoses = {}
        for name in self.slurm.names:
            path = folder / "gradsync_runs" / f"{job}.0" / name / "diagnosis.json"
            diagnoses[name] = json.loads(path.read_text()) if path.exists() else {}
        firsts = {name: (d.get("findings") or [{}])[0] for name, d in diagnoses.items()}
        outcome.notes.append(f"job {job} {fields['JobState']}; " + "; ".join(
            f"{name}: {first.get('category')} ranks {first.get('ranks')}" for name, first in firsts.items()))
        outcome.passed = _all(outcome, {
            "the job failed": fields["JobState"] == "FAILED",
            "both nodes diagnose the collective mismatch":
                all(first.get("category") == "collective_mismatch" for first in firsts.values()),
            "both nodes name both ranks' lines": all(set(d.get("ranks", {})) == {"0", "1"} for d in diagnoses.values()),
            "both nodes' launchers printed it": text.count("collective_mismatch") >= 2 or text.count("gradsync run: FAILED") >= 2,
        })

    def cancel_then_requeue(self, outcome: Outcome) -> None:
        folder, ckpt = self.prepare("scancel-requeue", job_script("progress", pause_s=0.5))
        job = self.submit(folder)
        reached = self.wait_progress(folder / "progress", EVERY + 2, job)
        self.slurm.command(["scancel", "--signal=TERM", job])
        first = self.slurm.wait(job, JOB_TIMEOUT_S)
        text = self.output(folder, job)
        saved = max(map(int, _COMMITTED.findall(text)), default=0)
        self.slurm.command(["scontrol", "requeue", job])
        second = self.slurm.wait(job, JOB_TIMEOUT_S)
        again = self.output(folder, job)
        resumed = [int(s) for s in _RESUMED.findall(again)]
        outcome.notes.append(f"job {job}: TERM at step {reached}, {first['JobState']}, final checkpoint of step {saved}; "
                             f"requeued (Restarts={second.get('Restarts')}): {second['JobState']}, resumed from {resumed}")
        outcome.passed = _all(outcome, {
            "SIGTERM made the trainer save a step after the last periodic one": saved > EVERY and saved % EVERY != 0,
            "the requeued job has its own run folder (SLURM_RESTART_COUNT=1)":
                all((folder / "gradsync_runs" / f"{job}.1" / name).is_dir() for name in self.slurm.names),
            "it resumed from the final checkpoint": saved in resumed,
            "it completed": second["JobState"] == "COMPLETED",
            "bitwise equal to the uninterrupted run": self.sha(again) == self.reference_sha is not None,
        })

    def time_limit_then_resubmit(self, outcome: Outcome) -> None:
        folder, ckpt = self.prepare("time-limit", job_script("progress", pause_s=NOTICE_STEP_PAUSE_S),
                                    time_limit=NOTICE_TIME_LIMIT)
        job = self.submit(folder)
        started = time.monotonic()
        first = self.slurm.wait(job, JOB_TIMEOUT_S)
        ended_s = time.monotonic() - started
        text = self.output(folder, job)
        saved = max(map(int, _COMMITTED.findall(text)), default=0)
        # Submitted again with a longer limit: the same script's next job would get its own notice
        # after about as many steps (that is the point of the notice), and a chain of them is slow.
        second_job = self.slurm.submit(folder / "train.sbatch", cwd=folder, env=self.env(), options=["--time=00:10:00"])
        second = self.slurm.wait(second_job, JOB_TIMEOUT_S)
        again = self.output(folder, second_job)
        resumed = [int(s) for s in _RESUMED.findall(again)]
        outcome.notes.append(f"job {job}: {first['JobState']} {ended_s:.0f} s after submission, final checkpoint of step "
                             f"{saved}; job {second_job} submitted again: {second['JobState']}, resumed from {resumed}")
        outcome.passed = _all(outcome, {
            "the notice stopped the job before its time limit": first["JobState"] != "TIMEOUT",
            "the trainer saved on the notice": "SIGTERM received" in text and saved > 0,
            "the job submitted again resumed from that checkpoint": saved in resumed,
            "it completed": second["JobState"] == "COMPLETED",
            "bitwise equal to the uninterrupted run": self.sha(again) == self.reference_sha is not None,
        })

    def workers_killed(self, outcome: Outcome) -> None:
        folder, ckpt = self.prepare("workers-killed", job_script("progress", pause_s=0.5))
        job = self.submit(folder)
        reached = self.wait_progress(folder / "progress", EVERY + 2, job)
        killed = []
        for launcher in self.slurm.pids(1, "--run-dir"):
            for worker in psutil.Process(launcher).children():
                worker.send_signal(signal.SIGKILL)
                killed.append(worker.pid)
        fields = self.slurm.wait(job, JOB_TIMEOUT_S)
        text = self.output(folder, job)
        resumed = [int(s) for s in _RESUMED.findall(text)]
        outcome.notes.append(f"job {job}: node1's workers {killed} SIGKILLed at step {reached}; {fields['JobState']}, "
                             f"resumed from {resumed}")
        outcome.passed = _all(outcome, {
            "a worker was killed": bool(killed),
            "the launchers restarted the workers": "restarting the workers as attempt 1" in text,
            "they resumed from a checkpoint": bool(resumed) and max(resumed) >= EVERY,
            "it completed": fields["JobState"] == "COMPLETED",
            "bitwise equal to the uninterrupted run": self.sha(text) == self.reference_sha is not None,
        })

    def doctor(self, outcome: Outcome) -> None:
        """`srun gradsync doctor` on the allocation: healthy, then with each mistake its Slurm checks
        look for (a launcher per task, GPUs torch cannot see, a rendezvous host that is no node,
        workers crowding their cores)."""
        folder = self.work / "doctor"
        folder.mkdir(parents=True, exist_ok=True)

        runs = iter(range(100))

        def doctor(srun: list[str], launch: list[str]) -> tuple[int, list[dict]]:
            # Each task's output to a file of its own: srun interleaves long lines of several tasks.
            label = f"run{next(runs)}"
            argv = ["srun", "-N2", f"--output={folder}/{label}-%t.out", *srun, "gradsync", "doctor", "--json",
                    "--checkpoint-dir", str(folder), "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-id", "doctor", *launch]
            done = self.slurm.command(argv, cwd=folder, env=self.env(), check=False, timeout=JOB_TIMEOUT_S)
            reports = [json.loads(line) for path in sorted(folder.glob(f"{label}-*.out"))
                       for line in path.read_text().splitlines() if line.startswith("{")]
            return done.returncode, reports

        def verdicts(report: dict) -> dict[str, str]:
            return {c["name"]: c["verdict"] for c in report["checks"] if c["name"].startswith("slurm")}

        endpoint = ["--rdzv-endpoint", f"{self.slurm.names[0]}:29400"]
        code, reports = doctor(["--ntasks-per-node=1", "--cpus-per-task=2"], ["--nproc-per-node", "1", *endpoint])
        healthy = len(reports) == 1 and reports[0]["world_size"] == 2 and code == 0
        healthy = healthy and set(verdicts(reports[0]).values()) == {"ok"} and len(reports[0]["hosts"]) == 2
        outcome.notes.append(f"healthy: exit {code}, {verdicts(reports[0]) if reports else 'no report'}")
        code, reports = doctor(["--ntasks-per-node=2", "--cpus-per-task=1"], ["--nproc-per-node", "1", *endpoint])
        per_task = code != 0 and len(reports) == 4 and all(verdicts(r)["slurm tasks"] == "problem" for r in reports)
        outcome.notes.append(f"two tasks per node: exit {code}, {len(reports)} reports, not launched")
        code, reports = doctor(["--ntasks-per-node=1", "--cpus-per-task=2", "--gpus-per-node=1"],
                               ["--nproc-per-node", "1", *endpoint])
        gpus = code != 0 and len(reports) == 1 and verdicts(reports[0]).get("slurm gpus") == "problem"
        outcome.notes.append(f"--gpus-per-node=1 that torch cannot see: exit {code}, "
                             f"{verdicts(reports[0]).get('slurm gpus') if reports else 'no report'}")
        code, reports = doctor(["--ntasks-per-node=1", "--cpus-per-task=2"],
                               ["--nproc-per-node", "1", "--rdzv-endpoint", "login01:29400"])
        stranger = code != 0 and len(reports) == 2 and all(verdicts(r)["slurm rendezvous"] == "problem" for r in reports)
        outcome.notes.append(f"rendezvous at login01: exit {code}, {len(reports)} reports, not launched")
        code, reports = doctor(["--ntasks-per-node=1", "--cpus-per-task=1"], ["--nproc-per-node", "2", *endpoint])
        crowded = code == 0 and len(reports) == 1 and verdicts(reports[0]).get("slurm cpus") == "warning"
        outcome.notes.append(f"2 workers on --cpus-per-task=1: exit {code}, "
                             f"{verdicts(reports[0]).get('slurm cpus') if reports else 'no report'}")
        outcome.passed = _all(outcome, {
            "healthy: every Slurm line ok, both nodes in one report": healthy,
            "a launcher per task: every task says so, nothing launched": per_task,
            "GPUs Slurm gave that torch does not see: a problem": gpus,
            "a rendezvous host that is not a node: every node says so, nothing launched": stranger,
            "two workers on one core: a warning": crowded,
        })


def _all(outcome: Outcome, conditions: Mapping[str, bool]) -> bool:
    for what, held in conditions.items():
        if not held:
            outcome.notes.append(f"NOT MET: {what}")
    return all(conditions.values())


BEHAVIOURS: dict[str, Callable[[Trials, Outcome], None]] = {
    "healthy": Trials.healthy,
    "broken": Trials.broken,
    "scancel-requeue": Trials.cancel_then_requeue,
    "time-limit-resubmit": Trials.time_limit_then_resubmit,
    "workers-killed": Trials.workers_killed,
    "doctor": Trials.doctor,
}


def table(outcomes: list[Outcome]) -> str:
    lines = ["| behaviour | result | seconds | what happened |", "|---|---|---|---|"]
    for o in outcomes:
        lines.append(f"| {o.name} | {'pass' if o.passed else 'FAIL'} | {o.seconds:.0f} | {'; '.join(o.notes)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "gradsync_runs" / "slurm-check")
    parser.add_argument("--only", default=None, help="comma-separated behaviours (healthy always runs: the reference)")
    args = parser.parse_args(argv)
    args.output = args.output.resolve()  # the jobs run elsewhere (each in its submission folder)
    # SIGTERM unwinds like Ctrl-C, so that the cluster stops its daemons (munged runs outside the
    # namespaces, which are deleted either way).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if os.geteuid() != 0:
        print("slurm-check: needs root (network namespaces and Slurm's daemons)", file=sys.stderr)
        return 2
    missing = missing_packages()
    if missing:
        print(f"slurm-check: installing {' '.join(missing)}", flush=True)
        install_packages(missing)
    names = list(BEHAVIOURS) if args.only is None else ["healthy", *[n for n in args.only.split(",") if n != "healthy"]]
    shutil.rmtree(args.output, ignore_errors=True)
    outcomes = []
    started = time.monotonic()
    with SlurmCluster(args.output / "cluster", SlurmSpec()) as slurm:
        version = slurm.command(["sinfo", "--version"]).stdout.strip()
        print(f"slurm-check: {version}, nodes {', '.join(slurm.names)} at {', '.join(slurm.addresses)}", flush=True)
        trials = Trials(slurm, args.output)
        for name in names:
            outcome = Outcome(name)
            began = time.monotonic()
            try:
                BEHAVIOURS[name](trials, outcome)
            except Exception as error:  # a harness failure is the trial's, never hides the table
                outcome.notes.append(f"harness: {type(error).__name__}: {error}")
            outcome.seconds = time.monotonic() - began
            print(f"slurm-check: {name}: {'pass' if outcome.passed else 'FAIL'} ({outcome.seconds:.0f} s) "
                  + "; ".join(outcome.notes), flush=True)
            outcomes.append(outcome)
    report = f"{version}, 2 nodes, {time.monotonic() - started:.0f} s\n\n{table(outcomes)}\n"
    (args.output / "table.md").write_text(report)
    print(report)
    return 0 if all(o.passed for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
