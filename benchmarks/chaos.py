"""`make chaos`: break a checkpointed training job in every way we know, many times, and check
that each run still ends with the parameters of a run that never broke, bit for bit.

Each trial runs `benchmarks/chaos_job.py` (the digits CNN trained by gradsync's trainer, with
checkpoints every 4 steps) under `gradsync run --max-restarts`, strikes once at a step drawn from
the trial's seed, and compares the final parameters' SHA-256 with an uninterrupted run of the
same world size. The faults:

- `sigkill`: SIGKILL of a random rank at a random step (2, 3 or 4 ranks);
- `sigkill-sync-save`, `sigkill-async-save`: SIGKILL while that rank writes a checkpoint;
- `sigstop`: a rank frozen with SIGSTOP (only the stall detector can notice it);
- `host-cut`: two simulated hosts; one host's link goes down for longer than the stall timeout,
  then comes back;
- `host-kill`: two simulated hosts; one dies with all its processes and is started again;
- `disk-full-sync`, `disk-full-async`: the checkpoint disk (a small tmpfs) fills up before a
  save, and gets its space back once the failure was reported;
- `corrupt-truncated`, `corrupt-flipped`, `corrupt-no-manifest`: the job is killed, its newest
  checkpoint is damaged, and the job is launched again.

Reported per kind: trials, finished, bitwise equal, steps lost (the fault's step minus the step
resumed from), time from the fault to its detection (the first line that says what happened:
gradsync run's FAILED verdict, the failed save, the skipped checkpoint) and from detection to
the resumed run's "resuming from" line. Kinds that need root (simulated hosts, tmpfs) are
skipped with the reason where it is missing.

    python benchmarks/chaos.py [--trials-per-kind 3] [--kinds sigkill,host-cut] [--seed 0] [--output table.md]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

REPO_ROOT = Path(__file__).resolve().parent.parent
JOB = "benchmarks/chaos_job.py"
EVERY = 4  # optimizer steps between the job's checkpoints
STALL_TIMEOUT_S = 10.0
TRIAL_TIMEOUT_S = 240.0
DISK = "16m"  # the tmpfs of the disk-full trials: three checkpoints of ~1.9 MB and room to spare

KINDS = (
    "sigkill", "sigkill-sync-save", "sigkill-async-save", "sigstop", "host-cut", "host-kill",
    "disk-full-sync", "disk-full-async", "corrupt-truncated", "corrupt-flipped", "corrupt-no-manifest",
)
_SHA = re.compile(r"^params sha256: ([0-9a-f]{64})$")
_RESUMED = re.compile(r"resuming from \S+ \(step (\d+)\)")
_COMMITTED = re.compile(r"checkpoint of step (\d+) committed")
_DETECTED = re.compile(r"gradsync run: FAILED|could not be written|skipping checkpoint|a save that never finished")


@dataclass(frozen=True)
class Trial:
    """One fault: `kind` on `rank` at optimizer step `step` of a `world_size`-rank job on `hosts`
    simulated hosts (1: localhost)."""

    kind: str
    seed: int
    world_size: int
    step: int
    rank: int
    hosts: int = 1

    @property
    def async_save(self) -> bool:
        return self.kind in ("sigkill-async-save", "disk-full-async")


@dataclass
class Outcome:
    trial: Trial
    finished: bool = False
    bitwise: bool = False
    steps_lost: int | None = None
    detect_s: float | None = None
    resume_s: float | None = None
    sha: str | None = None  # of the final parameters
    note: str = ""


# -- planning ----------------------------------------------------------------------------------


def plan(kinds: list[str], trials_per_kind: int, seed: int, total_steps: Callable[[int], int]) -> list[Trial]:
    """The trials, each one's world size, rank and step drawn from its own seed.

    `total_steps(world_size)`: the optimizer steps of an uninterrupted job, so that every fault
    strikes after the first checkpoint and before the end.
    """
    trials = []
    for kind in kinds:
        for index in range(trials_per_kind):
            trial_seed = seed * 1000 + KINDS.index(kind) * 100 + index
            draw = random.Random(trial_seed)
            hosts = 2 if kind.startswith("host-") else 1
            if kind in ("sigkill", "sigkill-sync-save", "sigkill-async-save"):
                world_size = (2, 3, 4)[index % 3]  # every world size, in turn
            elif kind == "sigstop":
                world_size = (2, 3)[index % 2]
            else:
                world_size = 2
            last = total_steps(world_size) - 2
            if kind.endswith("-save") or kind.startswith("disk-full"):
                step = EVERY * draw.randint(2, max(2, last // EVERY))  # a step that saves
            elif kind.startswith("corrupt"):
                step = draw.randint(2 * EVERY + 1, last)  # two checkpoints exist: one to damage, one to use
            else:
                step = draw.randint(EVERY + 1, last)
            trials.append(Trial(kind, trial_seed, world_size, step, draw.randrange(world_size), hosts))
    return trials


# -- launching -----------------------------------------------------------------------------------


class Launch:
    """One `gradsync run` (or one host's), its console lines timestamped as they arrive."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str], start: Callable[..., subprocess.Popen] | None = None) -> None:
        self.lines: list[tuple[float, str]] = []
        self._log = open(log, "a")
        popen = start or subprocess.Popen
        self.process = popen(argv, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, bufsize=1, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))
            self._log.write(line)
            self._log.flush()

    def first(self, pattern: re.Pattern[str], after: float = 0.0) -> tuple[float, re.Match[str]] | None:
        for stamp, line in list(self.lines):
            if stamp >= after and (match := pattern.search(line)):
                return stamp, match
        return None

    def wait(self, deadline: float) -> int | None:
        try:
            code = self.process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            code = None
        self._reader.join(timeout=10)
        self._log.close()
        return code

    def kill(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}


def _run_argv(world_size: int, run_dir: Path, options: list[str]) -> list[str]:
    return [sys.executable, "-m", "gradsync", "run", "--standalone", "--nproc-per-node", str(world_size),
            "--run-dir", str(run_dir), "--stall-timeout", str(STALL_TIMEOUT_S), *options]


def _job_argv(checkpoints: Path, progress: Path, async_save: bool) -> list[str]:
    return [JOB, "--checkpoint-dir", str(checkpoints), "--every", str(EVERY), "--progress", str(progress),
            *(["--async-save"] if async_save else [])]


def _host_argv(cluster: Any, host: int, port: int, run_dir: Path, options: list[str]) -> list[str]:
    addresses = [h.address for h in cluster.hosts]
    return [
        sys.executable, "-m", "gradsync", "run", "--nnodes", "2", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{addresses[0]}:{port}", "--rdzv-id", "chaos",
        # Hostnames do not resolve inside a namespace (../shared/README.md).
        "--local-addr", addresses[host], "--rdzv-conf", f"is_host={'true' if host == 0 else 'false'}",
        "--run-dir", str(run_dir), "--stall-timeout", str(STALL_TIMEOUT_S), *options,
    ]


def _wait_for(predicate: Callable[[], bool], deadline: float, poll_s: float = 0.02) -> bool:
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


def _progress(path: Path) -> int:
    try:
        return int(path.read_text() or 0)
    except (OSError, ValueError):
        return 0


def _reached(progress: Path, checkpoints: Path) -> int:
    """The step a job has reached: the last it reported, or a later one whose checkpoint was
    committed (a fault that strikes after a save's commit, before the step's report, loses nothing)."""
    committed = [int(manifest.parent.name.removeprefix("step-")) for manifest in checkpoints.glob("step-*/manifest.json")]
    return max([_progress(progress), *committed])


# -- references ----------------------------------------------------------------------------------


@dataclass
class Reference:
    sha: str
    steps: int


def reference(world_size: int, work: Path) -> Reference:
    """An uninterrupted run: the parameters every trial of this world size must end with."""
    work.mkdir(parents=True, exist_ok=True)
    launch = Launch(_run_argv(world_size, work / "run", []) + _job_argv(work / "ckpt", work / "progress", False),
                    work / "console.log", _env())
    code = launch.wait(time.monotonic() + TRIAL_TIMEOUT_S)
    sha = next((m[1] for _, line in launch.lines if (m := _SHA.match(line))), None)
    if code != 0 or sha is None:
        raise RuntimeError(f"the uninterrupted run on {world_size} ranks failed (exit {code}); see {work / 'console.log'}")
    return Reference(sha, _progress(work / "progress"))


# -- the trials ----------------------------------------------------------------------------------


def run_trial(trial: Trial, work: Path, expected: Reference) -> Outcome:
    work.mkdir(parents=True, exist_ok=True)
    runner = {
        "host-cut": _host_trial, "host-kill": _host_trial,
        "disk-full-sync": _disk_full_trial, "disk-full-async": _disk_full_trial,
    }.get(trial.kind, _corrupt_trial if trial.kind.startswith("corrupt") else _injected_trial)
    outcome = Outcome(trial)
    try:
        runner(trial, work, outcome)
    except Exception as error:  # a harness failure is reported as the trial's, never hides the table
        outcome.note = f"harness: {type(error).__name__}: {error}"
    outcome.bitwise = outcome.finished and outcome.sha == expected.sha
    if outcome.finished and not outcome.bitwise:
        outcome.note = "the final parameters differ from the uninterrupted run's"
    return outcome


def _finish(outcome: Outcome, launches: list[Launch], codes: list[int | None], fault_at: float, fault_step: int) -> None:
    """Read what the launches printed: finished or not, the final SHA, detection and resume."""
    main = launches[0]
    outcome.sha = next((m[1] for _, line in main.lines if (m := _SHA.match(line))), None)
    outcome.finished = all(code == 0 for code in codes) and outcome.sha is not None
    if not outcome.finished:
        outcome.note = f"exit codes {codes}; see {Path(main._log.name)}"
        return
    detected = min((hit[0] for launch in launches if (hit := launch.first(_DETECTED, fault_at))), default=None)
    if detected is not None:
        outcome.detect_s = max(0.0, detected - fault_at)
        resumed = main.first(_RESUMED, detected)
        if resumed is not None:
            outcome.resume_s = resumed[0] - detected
            outcome.steps_lost = fault_step - int(resumed[1][1])
        elif outcome.trial.kind == "disk-full-async":
            outcome.steps_lost = 0  # training went on past the failed background save


def _fault_time(run_dir: Path, rank: int) -> float | None:
    record = run_dir / "workers" / "attempt0" / f"fault-rank{rank}.json"
    try:
        return float(json.loads(record.read_text())["time"])
    except (OSError, ValueError, KeyError):
        return None


def _injected_trial(trial: Trial, work: Path, outcome: Outcome) -> None:
    action = {"sigstop": "stop"}.get(trial.kind, "kill")
    spec = f"{action}:rank={trial.rank}:step={trial.step}" + (":at=checkpoint" if trial.kind.endswith("-save") else "")
    run_dir = work / "run"
    launch = Launch(
        _run_argv(trial.world_size, run_dir, ["--max-restarts", "2", "--inject-fault", spec])
        + _job_argv(work / "ckpt", work / "progress", trial.async_save),
        work / "console.log", _env(),
    )
    code = launch.wait(time.monotonic() + TRIAL_TIMEOUT_S)
    fault_at = _fault_time(run_dir, trial.rank)
    if fault_at is None:
        outcome.note = f"the fault {spec} never fired"
        return
    _finish(outcome, [launch], [code], fault_at, trial.step)


def _corrupt_trial(trial: Trial, work: Path, outcome: Outcome) -> None:
    checkpoints, progress, run_dir = work / "ckpt", work / "progress", work / "run"
    job = _job_argv(checkpoints, progress, False)
    spec = f"kill:rank={trial.rank}:step={trial.step}"
    first = Launch(_run_argv(trial.world_size, run_dir, ["--inject-fault", spec]) + job, work / "console.log", _env())
    first.wait(time.monotonic() + TRIAL_TIMEOUT_S)
    committed = sorted(checkpoints.glob("step-*/manifest.json"))
    if len(committed) < 2:
        outcome.note = f"only {len(committed)} checkpoint(s) before the kill at step {trial.step}"
        return
    damage(committed[-1].parent, trial.kind.removeprefix("corrupt-"), random.Random(trial.seed))
    fault_at = time.time()
    again = Launch(_run_argv(trial.world_size, run_dir, []) + job, work / "console.log", _env())  # the job relaunched
    code = again.wait(time.monotonic() + TRIAL_TIMEOUT_S)
    _finish(outcome, [again], [code], fault_at, trial.step)


def damage(folder: Path, how: str, draw: random.Random) -> None:
    """Break a committed checkpoint as a disk or a careless copy would."""
    data = sorted(folder.glob("*.distcp"))
    if how == "no-manifest":
        (folder / "manifest.json").unlink()
    elif how == "truncated":
        victim = draw.choice(data)
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    elif how == "flipped":
        victim = draw.choice(data)
        blob = bytearray(victim.read_bytes())
        for index in draw.sample(range(len(blob)), 3):
            blob[index] ^= 0xFF
        victim.write_bytes(bytes(blob))
    else:
        raise ValueError(how)


def _disk_full_trial(trial: Trial, work: Path, outcome: Outcome) -> None:
    disk = work / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK}", "tmpfs", str(disk)], check=True)
    try:
        _disk_full_on(disk, trial, work, outcome)
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=False)


def _disk_full_on(disk: Path, trial: Trial, work: Path, outcome: Outcome) -> None:
    launch = Launch(
        _run_argv(trial.world_size, work / "run", ["--max-restarts", "2"])
        + _job_argv(disk / "ckpt", work / "progress", trial.async_save),
        work / "console.log", _env(),
    )
    deadline = time.monotonic() + TRIAL_TIMEOUT_S
    before = trial.step - EVERY  # fill the disk once the save before the doomed one is committed
    committed = lambda: any(int(m[1]) >= before for _, line in list(launch.lines) if (m := _COMMITTED.search(line)))  # noqa: E731
    ballast = disk / "ballast"
    if _wait_for(committed, deadline):
        with open(ballast, "wb") as stream:
            stream.write(b"\0" * max(0, shutil.disk_usage(disk).free - 64 * 1024))
        fault_at = time.time()
        # The space comes back once the failed save was reported, as an operator would free it.
        if _wait_for(lambda: launch.first(re.compile("could not be written"), fault_at) is not None, deadline):
            ballast.unlink()
    code = launch.wait(deadline)
    if not ballast.exists() and "fault_at" in locals():
        _finish(outcome, [launch], [code], fault_at, trial.step)
    else:
        outcome.note = "the disk never filled before the save, or the failed save was never reported"


def _host_trial(trial: Trial, work: Path, outcome: Outcome) -> None:
    from gradsync.bench.cluster import ClusterSpec, SimulatedCluster
    from gradsync.distributed import free_port

    progress = work / "progress"
    job = _job_argv(work / "ckpt", progress, False)
    port = free_port()
    with SimulatedCluster(ClusterSpec(hosts=2, link="1gbit")) as cluster:
        def start(host: int) -> Launch:
            argv = _host_argv(cluster, host, port, work / f"run-host{host}", ["--max-restarts", "2"]) + job
            return Launch(argv, work / f"console-host{host}.log", _env(), start=lambda a, **kw: cluster.run(host, a, **kw))

        launches = [start(0), start(1)]
        deadline = time.monotonic() + TRIAL_TIMEOUT_S
        if not _wait_for(lambda: _progress(progress) >= trial.step, deadline):
            outcome.note = f"the job never reached step {trial.step}"
            for launch in launches:
                launch.kill()
            return
        fault_at = time.time()
        # The step the job had reached when the fault struck is read once it has struck: no step
        # completes without both hosts, and the job may have gone on by a step or a checkpoint
        # while the fault was being set up (how far depends on how busy the machine is).
        if trial.kind == "host-cut":
            host = cluster.hosts[1]
            subprocess.run(["ip", "-n", host.name, "link", "set", host.interface, "down"], check=True)
            time.sleep(STALL_TIMEOUT_S + 5)  # longer than the stall timeout: both sides must give up on the other
            # The link stays down until both sides gave up and their workers have ended. A worker
            # asked to stop saves on SIGTERM: were the link back within that grace, the held-up
            # step and its save could still complete, and the job would resume from a step later
            # than the one read here (seen on a busy machine: steps lost -1).
            _wait_for(lambda: all(launch.first(_DETECTED, fault_at) for launch in launches)
                      and not any(JOB in line for index in range(2) for line in cluster.command_lines(index)),
                      min(deadline, time.monotonic() + 2 * STALL_TIMEOUT_S), poll_s=0.2)
            fault_step = _reached(progress, work / "ckpt")
            subprocess.run(["ip", "-n", host.name, "link", "set", host.interface, "up"], check=True)
            codes = [launch.wait(deadline) for launch in launches]
        else:
            cluster.kill_host(1)  # the host dies with its launcher and its worker
            launches[1].wait(deadline)
            fault_step = _reached(progress, work / "ckpt")
            time.sleep(2)
            launches.append(start(1))  # the host comes back and its launcher is started again
            codes = [launches[0].wait(deadline), launches[2].wait(deadline)]
            launches = [launches[0], launches[2]]
        _finish(outcome, launches, codes, fault_at, fault_step)


# -- the report ----------------------------------------------------------------------------------


def _spread(values: list[float], unit: str, digits: int = 1) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.{digits}f} / {max(values):.{digits}f}{unit}"


def table(outcomes: list[Outcome]) -> str:
    lines = [
        "| fault | trials | finished | bitwise equal | steps lost (median / max) | fault → detection (median / max) | detection → resume (median / max) |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind in KINDS:
        mine = [o for o in outcomes if o.trial.kind == kind]
        if not mine:
            continue
        sizes = sorted({o.trial.world_size for o in mine})
        where = f" ({', '.join(map(str, sizes))} ranks)" if kind.startswith(("sigkill", "sigstop")) else ""
        lines.append(
            f"| {kind}{where} | {len(mine)} | {sum(o.finished for o in mine)} | {sum(o.bitwise for o in mine)} | "
            f"{_spread([o.steps_lost for o in mine if o.steps_lost is not None], '', 0)} | "
            f"{_spread([o.detect_s for o in mine if o.detect_s is not None], ' s')} | "
            f"{_spread([o.resume_s for o in mine if o.resume_s is not None], ' s')} |"
        )
    total = len(outcomes)
    lines.append(f"| **all** | {total} | {sum(o.finished for o in outcomes)} | {sum(o.bitwise for o in outcomes)} | | | |")
    return "\n".join(lines)


def root_problem(kind: str) -> str | None:
    """Why a kind cannot run on this machine (None: it can)."""
    if kind.startswith("host-"):
        from gradsync.bench.cluster import available

        return available()
    if kind.startswith("disk-full") and os.geteuid() != 0:
        return "mounting a small tmpfs needs root"
    return None


def run_all(kinds: list[str], trials_per_kind: int, seed: int, root: Path, log: Callable[[str], None] = print) -> list[Outcome]:
    """Plan, run the references and the trials, and return every trial's outcome."""
    skipped = {kind: why for kind in kinds if (why := root_problem(kind))}
    for kind, why in skipped.items():
        log(f"skipping {kind}: {why}")
    kinds = [kind for kind in kinds if kind not in skipped]
    references: dict[int, Reference] = {}

    def expected(world_size: int) -> Reference:
        if world_size not in references:
            references[world_size] = reference(world_size, root / f"reference-{world_size}")
        return references[world_size]

    trials = plan(kinds, trials_per_kind, seed, lambda world_size: expected(world_size).steps)
    outcomes = []
    for index, trial in enumerate(trials):
        started = time.monotonic()
        outcome = run_trial(trial, root / f"trial-{index:02d}-{trial.kind}", expected(trial.world_size))
        outcomes.append(outcome)
        verdict = "bitwise" if outcome.bitwise else ("finished, NOT bitwise" if outcome.finished else "FAILED")
        log(f"[{index + 1}/{len(trials)}] {trial.kind} ({trial.world_size} ranks, rank {trial.rank}, step {trial.step}): "
            f"{verdict} in {time.monotonic() - started:.0f} s"
            + (f", detected in {outcome.detect_s:.1f} s" if outcome.detect_s is not None else "")
            + (f" - {outcome.note}" if outcome.note else ""))
    return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials-per-kind", type=int, default=3)
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of: {', '.join(KINDS)}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None, help="also write the table (markdown) here")
    parser.add_argument("--keep", action="store_true", help="keep every trial's folder (logs, run dirs)")
    args = parser.parse_args(argv)
    kinds = [kind.strip() for kind in args.kinds.split(",") if kind.strip()]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        parser.error(f"unknown kind(s) {', '.join(unknown)}; choose from {', '.join(KINDS)}")
    root = Path(tempfile.mkdtemp(prefix="gradsync-chaos-"))
    started = time.monotonic()
    outcomes = run_all(kinds, args.trials_per_kind, args.seed, root)
    report = table(outcomes)
    late = [o for o in outcomes if o.detect_s is not None and o.detect_s > STALL_TIMEOUT_S + 10]
    summary = (f"{len(outcomes)} trials in {(time.monotonic() - started) / 60:.1f} min, stall timeout {STALL_TIMEOUT_S:.0f} s: "
               f"{sum(o.bitwise for o in outcomes)} bitwise equal to the uninterrupted run; "
               f"{len(late)} detected later than stall timeout + 10 s")
    print(f"\n{report}\n\n{summary}")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(f"{report}\n\n{summary}\n")
    if args.keep:
        print(f"trial folders: {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if outcomes and all(o.bitwise for o in outcomes) and not late else 1


if __name__ == "__main__":
    sys.exit(main())
