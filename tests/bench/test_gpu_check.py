"""benchmarks/gpu_check.py (`make gpu-check`) on a machine without CUDA, and its table and exit code."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from benchmarks import gpu_check
from benchmarks.gpu_check import CheckFailed, CheckSkipped, Done, Result, Runner
from tests.harness import REPO_ROOT


@pytest.mark.launches
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script would run its checks")
def test_without_cuda_it_says_so_in_one_line_and_exits_0(tmp_path):
    output = tmp_path / "table.md"
    done = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--output", str(output)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [done.stdout.strip()] and "no CUDA device" in done.stdout
    assert done.stderr == ""
    assert not output.exists()


def _raise(error: Exception):
    def check() -> str:
        raise error

    return check


def test_each_outcome_of_a_check_becomes_its_row():
    assert gpu_check.run_check("a", lambda: "12 steps") == Result("a", "ok", "12 steps")
    assert gpu_check.run_check("b", _raise(CheckFailed("accuracy 40%"))) == Result("b", "failed", "accuracy 40%")
    assert gpu_check.run_check("c", _raise(CheckSkipped("no pynvml"))) == Result("c", "skipped", "no pynvml")
    # A bug in reading a run's files fails that check only.
    assert gpu_check.run_check("d", _raise(KeyError("steps"))) == Result("d", "failed", "KeyError: 'steps'")


def test_a_failed_check_makes_the_exit_code_non_zero_and_a_skipped_one_does_not():
    ok, skipped, failed = Result("a", "ok", "x"), Result("b", "skipped", "y"), Result("c", "failed", "z")
    assert gpu_check.exit_code([ok, skipped]) == 0
    assert gpu_check.exit_code([ok, failed, skipped]) == 1


def test_the_markdown_table_keeps_one_row_per_check_whatever_the_output_held():
    results = [Result("demo", "ok", "accuracy 97%"), Result("bench", "failed", "exited 1; last lines: a | b\n  c")]
    table = gpu_check.markdown_table(results, "gpu-check on Fake GPU")
    lines = table.splitlines()
    assert lines[0] == "# gpu-check on Fake GPU"
    assert lines[2:] == [
        "| path | result | what it measured |",
        "|---|---|---|",
        "| demo | ok | accuracy 97% |",
        "| bench | failed | exited 1; last lines: a \\| b c |",
    ]
    console = gpu_check.console_table(results).splitlines()
    assert len(console) == 3 and console[2] == "bench  failed   exited 1; last lines: a | b c"


def test_a_failing_command_is_reported_with_its_last_lines(tmp_path):
    log = tmp_path / "x.log"
    output = "".join(f"line {i}\n" for i in range(10))
    with pytest.raises(CheckFailed, match=r"exited 3; last lines: line 6 / line 7 / line 8 / line 9"):
        Done(3, output, log).require_success("the sweep")
    with pytest.raises(CheckFailed, match="the sweep hung"):
        Done(None, output, log).require_success("the sweep")
    assert Done(0, output, log).require_success("the sweep").returncode == 0


@pytest.mark.launches
def test_a_hanging_command_is_killed_at_its_timeout_and_the_budget_stops_the_rest(tmp_path):
    runner = Runner(tmp_path, budget_s=60)
    done = runner.run("sleeper", [sys.executable, "-c", "print('started', flush=True); import time; time.sleep(60)"],
                      timeout_s=1)
    assert done.returncode is None and done.output == "started\n" and done.log == tmp_path / "sleeper.log"
    spent = Runner(tmp_path, budget_s=0)
    with pytest.raises(CheckSkipped, match="budget"):
        spent.run("late", [sys.executable, "-c", "pass"], timeout_s=10)


def test_on_a_gpu_the_table_is_printed_written_and_a_failure_fails_the_script(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check.torch.cuda, "get_device_name", lambda index: "Fake GPU")
    checks = [("demo", lambda: "accuracy 97%"), ("nvml", _raise(CheckSkipped("skipped: pynvml not installed"))),
              ("bench", _raise(CheckFailed("exited 1")))]
    monkeypatch.setattr(gpu_check.Checks, "all", lambda self: checks)
    output = tmp_path / "gpu" / "table.md"
    assert gpu_check.main(["--output", str(output)]) == 1
    table = output.read_text()
    assert table.startswith("# gpu-check on Fake GPU")
    assert "| demo | ok | accuracy 97% |" in table and "| bench | failed | exited 1 |" in table
    assert "| nvml | skipped | skipped: pynvml not installed |" in table
    printed = capsys.readouterr().out
    assert "1 ok, 1 failed, 1 skipped" in printed and str(output) in printed
