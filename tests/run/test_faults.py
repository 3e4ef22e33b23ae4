"""`--inject-fault`, restarts and a stop from outside, under the real `gradsync run` (2 processes, Gloo).

The real runs use the zoo's healthy plain-DDP script, where step n is the n-th backward pass,
so every failure in them is one gradsync injected on purpose.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradsync.errors import ConfigError
from gradsync.run import launcher
from gradsync.run.analysis.attempts import unfired_fault_findings
from gradsync.run.faults import FaultSpec, parse_fault, parse_faults
from gradsync.run.options import RunOptions
from tests.harness import REPO_ROOT

HEALTHY = "tests/run/zoo/healthy_ddp.py"  # 16 synchronised backward passes per rank
# A hang detector for one real `gradsync run` of 2 ranks: on 2 cores shared with other test runs
# the slowest below (two attempts each) took 90-138 s, the others 23-88 s; what it catches is a
# job left to Gloo's 30-minute timeout. 900 s is >= 5x the slowest and half of Gloo's timeout.
RUN_HANG_S = 900


@pytest.mark.parametrize(
    "text, spec",
    [
        ("kill:rank=1:step=5", FaultSpec("kill", 1, 5)),
        ("exit:rank=0:step=3:code=7", FaultSpec("exit", 0, 3, code=7)),
        ("hang:rank=1:step=4", FaultSpec("hang", 1, 4)),
        ("stop:rank=0:step=2", FaultSpec("stop", 0, 2)),
        ("kill:rank=1:step=6:at=checkpoint", FaultSpec("kill", 1, 6, at="checkpoint")),
        ("kill:rank=1:step=5:attempt=1", FaultSpec("kill", 1, 5, attempt=1)),
        (" exit:code=3:step=2:rank=0 ", FaultSpec("exit", 0, 2, code=3)),
    ],
)
def test_good_specs_parse_and_print_back(text, spec):
    assert parse_fault(text) == spec
    assert parse_fault(str(spec)) == spec


@pytest.mark.parametrize(
    "text, problem",
    [
        ("", "not an action"),
        ("crash:rank=1:step=5", "'crash', not an action"),
        ("kill:rank=1", "step missing"),
        ("kill:step=5", "rank missing"),
        ("kill:rank=1:step=five", "step=five is not a whole number"),
        ("kill:rank=1:step=0", "steps count from 1"),
        ("kill:rank=-1:step=2", "ranks count from 0"),
        ("kill:rank=1:step=2:code=3", "code= only applies to exit"),
        ("exit:rank=1:step=2:code=0", "0 means success"),
        ("kill:rank=1:step=2:at=epoch", "at=step or at=checkpoint"),
        ("kill:rank=1:step=2:when=later", "unknown field 'when'"),
        ("kill:rank=1:rank=2:step=2", "rank is given twice"),
        ("kill:rank=1:step", "'step' is not key=value"),
    ],
)
def test_bad_specs_say_what_is_wrong_and_show_a_correct_one(text, problem):
    with pytest.raises(ConfigError) as error:
        parse_fault(text)
    assert problem in str(error.value)
    assert "e.g. kill:rank=1:step=5" in str(error.value)


def test_two_faults_at_the_same_place_are_refused_and_options_carry_the_specs(tmp_path):
    with pytest.raises(ConfigError, match="both fire on rank 1"):
        parse_faults(["kill:rank=1:step=5", "hang:rank=1:step=5"])
    assert len(parse_faults(["kill:rank=1:step=5", "kill:rank=1:step=5:attempt=1"])) == 2
    options = RunOptions(run_dir=tmp_path, faults=("kill:rank=1:step=3", "exit:rank=0:step=2:code=7"))
    assert RunOptions.load(options.save()) == options


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--inject-fault", "kill:rank=1"], "step missing"),
        (["--nproc-per-node", "2", "--inject-fault", "kill:rank=2:step=1"], "the job has ranks 0-1"),
        (["--inject-fault", "kill:rank=0:step=1:attempt=1"], "attempt 1 never runs"),
    ],
)
def test_gradsync_run_refuses_a_fault_that_cannot_fire(arguments, message, tmp_path, capsys):
    assert launcher.main([*arguments, "--run-dir", str(tmp_path), "train.py"]) == 2
    assert message in capsys.readouterr().err


_TRIGGER = """
import sys
from pathlib import Path
from gradsync import events
from gradsync.run import faults, injector
specs = faults.parse_faults(["exit:rank=0:step=2:code=7", "exit:rank=1:step=1:code=9", "exit:rank=0:step=1:code=8:attempt=1"])
injector.arm(specs, rank=0, attempt=0, record_path=Path(sys.argv[1]))
events.optimizer_step(1)  # another rank's step and another attempt's
events.checkpoint_written(2)  # the fault is at the step, not in its checkpoint
events.claim_steps()
events.backward_pass(2)  # steps are claimed: backward passes no longer count
print("still running", flush=True)
events.optimizer_step(2)
print("not reached", flush=True)
"""


@pytest.mark.launches
def test_a_fault_fires_on_its_rank_attempt_and_step_only_and_leaves_a_record(tmp_path):
    record = tmp_path / "fault.json"
    # A hang detector: the script takes well under a second (one Python start, no torch); 60 s is >= 5x.
    done = subprocess.run([sys.executable, "-c", _TRIGGER, str(record)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 7, done.stderr
    assert done.stdout == "still running\n"
    assert done.stderr.strip().splitlines()[-1] == (
        "gradsync: injected fault (--inject-fault exit:rank=0:step=2:code=7): exiting rank 0 with code 7 at step 2, attempt 0"
    )
    assert json.loads(record.read_text())["spec"] == "exit:rank=0:step=2:code=7"


def test_faults_that_never_fired_are_reported_so_a_clean_run_is_not_mistaken_for_a_rehearsal():
    specs = parse_faults(["kill:rank=1:step=3", "kill:rank=0:step=500", "hang:rank=1:step=2:attempt=2"])
    fired = {0: {1: {"spec": "kill:rank=1:step=3"}}}
    findings = unfired_fault_findings(specs, fired, last_attempt=1)
    assert [(f.category, f.severity, f.ranks) for f in findings] == [("fault_not_fired", "warning", [0]), ("fault_not_fired", "warning", [1])]
    assert "rank 0 never reached step 500 in attempt 0" in findings[0].message
    assert "attempt 2 never ran (the job ended with attempt 1)" in findings[1].message


# -- real runs ----------------------------------------------------------------------------------


def _gradsync_run(run_dir: Path, *options: str, script: str = HEALTHY) -> tuple[int, str, dict]:
    done = subprocess.run(
        [sys.executable, "-m", "gradsync", "run", "--standalone", "--nproc-per-node", "2",
         "--run-dir", str(run_dir), *options, script],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=RUN_HANG_S, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return done.returncode, done.stdout + done.stderr, json.loads((run_dir / "diagnosis.json").read_text())


def _attempt_diagnosis(run_dir: Path, attempt: int) -> dict:
    return json.loads((run_dir / "workers" / f"attempt{attempt}" / "diagnosis.json").read_text())


@pytest.mark.launches
@pytest.mark.timeout(RUN_HANG_S + 60)
def test_killed_rank_is_diagnosed_as_injected_and_the_restarted_job_recovers(tmp_path):
    code, output, final = _gradsync_run(tmp_path, "--max-restarts", "1", "--inject-fault", "kill:rank=1:step=3")
    assert code == 0, output
    assert output.count("gradsync: injected fault (--inject-fault kill:rank=1:step=3): killing rank 1 at step 3, attempt 0") == 1
    assert "restarting the workers as attempt 1" in output

    first = _attempt_diagnosis(tmp_path, 0)
    (cause,) = [f for f in first["findings"] if f["severity"] == "error"]
    assert (first["status"], cause["category"], cause["ranks"], cause["step"]) == ("failed", "rank_crashed", [1], 3), first
    assert "injected by --inject-fault kill:rank=1:step=3" in cause["message"]

    assert final["status"] == "ok" and final["attempt"] == 1, final
    assert [(a["attempt"], a["status"]) for a in final["attempts"]] == [(0, "failed"), (1, "ok")]
    (restarted,) = final["findings"]
    assert restarted["category"] == "restarted" and restarted["severity"] == "warning"
    assert "attempt 0 failed (rank_crashed: Rank 1 was killed" in restarted["message"]
    assert "warning: restarted" in output


@pytest.mark.launches
@pytest.mark.timeout(RUN_HANG_S + 60)
def test_exit_fault_exits_with_its_code_and_the_diagnosis_names_the_rank(tmp_path):
    code, output, diagnosis = _gradsync_run(tmp_path, "--inject-fault", "exit:rank=0:step=3:code=7")
    assert code == 1, output
    assert "(exitcode: 7)" in (tmp_path / "launcher.log").read_text(), "torchrun's agent saw the injected exit code"
    assert "(exitcode: 7)" not in output, "the agent's own lines stay in launcher.log"
    (cause,) = [f for f in diagnosis["findings"] if f["severity"] == "error"]
    assert (cause["category"], cause["ranks"], cause["step"]) == ("rank_crashed", [0], 3), diagnosis
    assert cause["message"].startswith("Rank 0 exited with code 7 at step 3 of attempt 0: injected by --inject-fault")
    assert "FAILED: rank_crashed (rank 0)" in output


@pytest.mark.launches
@pytest.mark.timeout(RUN_HANG_S + 60)
@pytest.mark.parametrize("action,outcome", [("hang", "hung"), ("stop", "was frozen (SIGSTOP)")])
def test_a_hung_or_frozen_rank_is_diagnosed_as_a_stall_and_the_stopped_workers_are_restarted(tmp_path, action, outcome):
    # A frozen (SIGSTOPped) process runs no thread at all, its snapshots included; the stall
    # detector must still notice it, and SIGKILL stop it (SIGTERM waits until it continues).
    code, output, final = _gradsync_run(
        tmp_path, "--stall-timeout", "5", "--max-restarts", "1", "--inject-fault", f"{action}:rank=1:step=4"
    )
    assert code == 0, output
    stall = _attempt_diagnosis(tmp_path, 0)
    # The monitor's stall diagnosis, with the timeout given: the hang was stopped by gradsync's
    # stall timeout, not by Gloo's 30 minutes (that would end the attempt as a "failure").
    assert (stall["trigger"], stall["stall_timeout_s"]) == ("stall", 5), stall
    (cause,) = [f for f in stall["findings"] if f["severity"] == "error"]
    assert (cause["category"], cause["ranks"], cause["step"]) == ("rank_stuck", [1], 4), stall
    assert f"Rank 1 {outcome} at step 4" in cause["message"]
    assert f"injected by --inject-fault {action}:rank=1:step=4" in cause["message"]
    assert final["status"] == "ok" and [a["status"] for a in final["attempts"]] == ["failed", "ok"], final


@pytest.mark.launches
@pytest.mark.timeout(RUN_HANG_S + 60)
def test_sigterm_gives_workers_time_to_save_and_ends_the_job_cleanly_with_143(tmp_path):
    markers, run_dir = tmp_path / "markers", tmp_path / "run"
    markers.mkdir()
    with open(tmp_path / "output", "w+") as output_file:
        job = subprocess.Popen(
            [sys.executable, "-m", "gradsync", "run", "--standalone", "--nproc-per-node", "2", "--shutdown-timeout", "20",
             "--run-dir", str(run_dir), "tests/run/zoo/save_on_sigterm.py", "--marker-dir", str(markers)],
            cwd=REPO_ROOT, stdout=output_file, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        try:
            # One hang detector for the whole run (see RUN_HANG_S). After the SIGTERM the workers
            # save and end within a second or so; --shutdown-timeout 20 (>= 5x that) is how long
            # the launcher lets them before it kills them, which the markers would show.
            deadline = time.monotonic() + RUN_HANG_S
            while not all((markers / f"ready-rank{r}").exists() for r in (0, 1)):
                assert job.poll() is None and time.monotonic() < deadline, output_file.read()
                time.sleep(0.2)
            job.send_signal(signal.SIGTERM)
            code = job.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
        output_file.seek(0)
        output = output_file.read()
    assert code == 143, output
    assert [(markers / f"saved-rank{r}").read_text() for r in (0, 1)] == ["SIGTERM", "SIGTERM"], output
    assert "Traceback" not in output, output
    assert "gradsync run: stopped by SIGTERM; workers were asked to stop and given 20 s to save" in output
    diagnosis = json.loads((run_dir / "diagnosis.json").read_text())
    assert diagnosis["status"] == "stopped", diagnosis
    assert [(f["category"], f["severity"]) for f in diagnosis["findings"]] == [("stopped_by_signal", "warning")]
