"""Running scripts under `gradsync run --doctor-steps K` for the script check's tests, and reading
what each run left: its diagnosis, its facts files, its output, the lines its scripts mark.

Lines are found by their `# doctor: <tag>` (tests/run/doctor_zoo) or `# zoo: <tag>` (tests/run/zoo)
markers. Two test files use it (test_doctor_script.py, test_doctor_consistency.py), each with its own
session of runs, so that `make test`'s workers can run them side by side. Each launches only its
LIVE scripts under `make test` and makes the others' diagnoses again from their recordings
(tests/run/recordings.py); `make test-zoo` launches them all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from gradsync.run.analysis.evidence import Evidence, read_evidence
from gradsync.rundir import RunDir
from tests.harness import REPO_ROOT, fixture_timeout_s
from tests.run import user_view
from tests.run.recordings import Runs, launched_names, record, recording, remade
from tests.run.user_view import UserView
from tests.timed_findings import untimed

RUN_TESTS = Path(__file__).parent


@dataclass
class DoctorRun:
    """A script's run under --doctor-steps: launched (`live`), or made again from its recording,
    which has no exit code, no run folder and, for output, the terminal block of its diagnosis."""

    name: str
    script: str  # under tests/run
    steps: int  # K
    returncode: int | None
    output: str
    diagnosis: dict
    run_dir: Path | None
    evidence: Evidence | None = None
    # What the user saw of it: how each rank ended and what the script printed (tests/run/user_view.py).
    user_view: UserView | None = None

    @property
    def live(self) -> bool:
        return self.run_dir is not None

    def line(self, tag: str) -> str:
        """'tests/run/<script>:LINE' of the line marked `# doctor: tag` (or `# zoo: tag`)."""
        marker = "zoo" if self.script.startswith("zoo/") else "doctor"
        text = (RUN_TESTS / self.script).read_text().splitlines()
        numbers = [i for i, line in enumerate(text, 1) if line.rstrip().endswith(f"# {marker}: {tag}")]
        assert len(numbers) == 1, f"{self.script} must mark exactly one line with '# {marker}: {tag}'"
        return f"tests/run/{self.script}:{numbers[0]}"

    def findings(self) -> list[dict]:
        """The findings, but those judged from timings (tests/timed_findings.py)."""
        return untimed(self.diagnosis["findings"])

    def only(self, category: str, severity: str) -> dict:
        """The run's one finding, which must be `category` with `severity`."""
        assert [(f["category"], f["severity"]) for f in self.findings()] == [(category, severity)], self.explain()
        return self.findings()[0]

    def facts(self, rank: int) -> dict:
        if not self.live:
            return self.evidence.script_checks[rank]
        return json.loads((self.run_dir / "workers" / "attempt0" / f"script-check-rank{rank}.json").read_text())

    def exit_record(self, rank: int) -> dict:
        if not self.live:
            return self.evidence.views[rank].exit
        return json.loads((self.run_dir / "workers" / "attempt0" / f"rank{rank}.exit.json").read_text())["exit"]

    def explain(self) -> str:
        how = f"exit {self.returncode}" if self.live else "made again from its recording"
        return f"{self.name}: {how}\n{json.dumps(self.diagnosis, indent=1)}\n{self.output[-3000:]}"


# Each run's hang guard; `run_all` runs them AT_A_TIME at a time.
RUN_TIMEOUT_S = 150
AT_A_TIME = 2


def guard_of(scripts: dict[str, tuple[str, int]]) -> pytest.MarkDecorator:
    """pytest's hang guard for a test file whose fixture runs `scripts` with `run_all`."""
    return pytest.mark.timeout(fixture_timeout_s(len(scripts), AT_A_TIME, RUN_TIMEOUT_S))


def _options(steps: int) -> list[str]:
    return ["--nproc-per-node", "2", "--doctor-steps", str(steps), "--stall-timeout", "20"]


def run_one(name: str, script: str, steps: int, root: Path) -> DoctorRun:
    run_dir = root / name
    command = [
        sys.executable, "-m", "gradsync", "run", "--standalone", *_options(steps),
        "--run-dir", str(run_dir), f"tests/run/{script}",
    ]
    # A script stopped after K steps never reaches its own clean-up: its temporary files go to `root`.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(root)}
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env)
    path = run_dir / "diagnosis.json"
    diagnosis = json.loads(path.read_text()) if path.exists() else {"findings": [], "missing": True}
    evidence = read_evidence(RunDir(run_dir).attempt_evidence(0))
    logs = {rank: RunDir(run_dir).log(0, rank) for rank in range(2)}
    seen = user_view.gradsync(evidence, {rank: log.read_text(errors="replace") for rank, log in logs.items() if log.exists()},
                              done.stdout) if evidence else None
    return DoctorRun(name, script, steps, done.returncode, done.stdout + done.stderr, diagnosis, run_dir, user_view=seen)


def run_all(scripts: dict[str, tuple[str, int]], live: list[str], folder: str, mode: str, root: Path) -> Runs:
    """The runs of `scripts` (name -> (script under tests/run, K)): those `mode` launches (the
    `live` ones under --zoo=recorded), AT_A_TIME at a time, the others from their recordings
    under tests/run/zoo_recorded/`folder`."""
    start = time.monotonic()
    names = launched_names(mode, list(scripts), live)
    with ThreadPoolExecutor(max_workers=AT_A_TIME) as pool:
        runs = list(pool.map(lambda name: run_one(name, *scripts[name], root), names))
    print(f"\n{len(runs)} --doctor-steps runs in {time.monotonic() - start:.0f} s", file=sys.stderr)
    if mode == "record":
        for run in runs:
            record(f"{folder}/{run.name}", RUN_TESTS / run.script, _options(run.steps), run.run_dir,
                   run.user_view.as_dict() if run.user_view else None)

    def from_recording(name: str) -> DoctorRun:
        script, steps = scripts[name]
        evidence, diagnosis, output = remade(f"{folder}/{name}", RUN_TESTS / script, _options(steps))
        seen = recording(f"{folder}/{name}", RUN_TESTS / script, _options(steps)).get("user_view")
        return DoctorRun(name, script, steps, None, output, diagnosis, None, evidence,
                         UserView.from_dict(seen) if seen else None)

    return Runs({run.name: run for run in runs}, list(scripts), from_recording)



def assert_failed(run: DoctorRun, category: str) -> None:
    assert not run.live or run.returncode == 1, run.explain()
    assert run.diagnosis["status"] == "failed", run.explain()
    assert f"gradsync run: FAILED: {category} (ranks 0, 1)" in run.output, run.explain()


def assert_warned(run: DoctorRun, category: str) -> None:
    assert not run.live or run.returncode == 0, run.explain()
    assert run.diagnosis["status"] == "ok", run.explain()
    assert f"warning: {category} (ranks [0, 1])" in run.output, run.explain()


# -- the differential test: what the user sees, under plain torchrun and under --doctor-steps K ------
#
# Plain torchrun's side runs the script under tests/run/stop_after_steps.py, which ends each rank
# right after its K-th optimizer step as the doctor does, and imports nothing of gradsync. It does
# not depend on gradsync: it is recorded once per version of a script, of K and of torch, in
# zoo_recorded/torchrun_steps, by `make zoo-record` where it is missing or stale. A run still going
# after PLAIN_BOUND_S is hung there (K steps of a zoo script take 5-30 s, and 90 s ran out on a 2-core
# machine at load 15).
PLAIN_BOUND_S = 150
STOPPER = "tests/run/stop_after_steps.py"


def _plain_key(name: str, script: str, steps: int) -> tuple[str, Path, list[str]]:
    """The recording's key, its script, and what the run depends on besides the script: torch's
    version, the ranks, K, and the version of the stopper itself."""
    import hashlib

    import torch

    stopper = hashlib.sha256((REPO_ROOT / STOPPER).read_bytes()).hexdigest()[:16]
    return f"torchrun_steps/{name}", RUN_TESTS / script, [f"torch=={torch.__version__}", "--nproc-per-node", "2",
                                                          "--steps", str(steps), f"stopper={stopper}"]


def plain_views(scripts: dict[str, tuple[str, int]], mode: str, root: Path) -> Runs:
    """name -> the user's view of the script's first K steps under plain torchrun, as recorded
    (launched and recorded first under --zoo=record where its recording is missing or stale)."""
    from tests.run.recordings import is_current, keep

    if mode == "record":
        stale = [name for name, (script, steps) in scripts.items() if not is_current(*_plain_key(name, script, steps))]

        def run(name: str) -> None:
            script, steps = scripts[name]
            folder = root / name
            folder.mkdir(parents=True, exist_ok=True)
            # TMPDIR is the runs' root, as for the doctor's runs (run_one): under a script's own folder its path is
            # too long for the AF_UNIX socket a DataLoader's workers share tensors through.
            seen = user_view.torchrun_twice(STOPPER, 2, [str(steps), f"tests/run/{script}"], REPO_ROOT, folder / "logs",
                                            PLAIN_BOUND_S, env={"TMPDIR": str(root)})
            keep(*_plain_key(name, script, steps), {"user_view": seen.as_dict()})

        with ThreadPoolExecutor(max_workers=AT_A_TIME) as pool:
            list(pool.map(run, stale))
    return Runs({}, list(scripts), lambda name: UserView.from_dict(recording(*_plain_key(name, *scripts[name]))["user_view"]))


def assert_as_under_plain_torchrun(run: DoctorRun, plain: UserView) -> None:
    """Each rank's end (its exit code, the last exception it raised, by type and zoo line) and what
    the script printed: the same under --doctor-steps K as under plain torchrun stopped after the
    same K steps, but for the differences docs/run.md lists for `gradsync run` (user_view.differences)."""
    assert run.user_view is not None, f"{run.name}'s recording has no user view: run `make zoo-record`"
    assert user_view.differences(plain, run.user_view) == [], run.explain()
