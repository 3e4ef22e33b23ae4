"""`gradsync run` on a zoo of broken and healthy unmodified scripts (tests/run/zoo), 2 processes each.

Every script runs once per session under the real launcher (torchrun's agent, Gloo), two at a
time; the tests then read each run's diagnosis.json and terminal output. Lines are found by
their `# zoo: <tag>` markers, so the assertions name the exact line a user would fix.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests.harness import REPO_ROOT

ZOO = Path(__file__).parent / "zoo"
STALL_TIMEOUT_S = 5
HEALTHY = [
    "healthy_ddp",
    "healthy_join",
    "healthy_accumulation",
    "healthy_bn_eval",
    "healthy_objects",
    "healthy_gradsync",
    "healthy_spawn",
    "healthy_compiled",
    "healthy_fsdp2_tp",
    "healthy_p2p_and_functional",
]
# Scripts launched with another --nproc-per-node than 2.
NPROC = {"healthy_spawn": 1}
BROKEN = [
    "uneven_batches_barrier",
    "barrier_inside_rank0",
    "continue_bad_batch",
    "early_stop_alone",
    "metric_allreduce_rank0",
    "bn_eval_rank0",
    "allgather_shape_mismatch",
    "nan_on_rank1",
    "killed_worker",
    "raise_on_rank1",
    "rank_dependent_branch",
    "unused_parameter",
    "unused_parameter_find",
    "straggler",
    "stuck_rank",
    "teardown_crash",
    "timed_hang",
    "dataloader_worker_hang",
    "user_timeout_error",
    "timeout_waiting_for_poller",
    "extra_scalar_all_reduce",
    "skipped_send",
    "subgroup_vs_default",
    "full_tensor_on_rank0",
]


@dataclass
class ZooRun:
    name: str
    returncode: int
    output: str
    diagnosis: dict
    seconds: float
    run_dir: Path
    stdout: str = ""

    def line(self, tag: str) -> str:
        """'tests/run/zoo/NAME.py:LINE' of the line marked `# zoo: tag`."""
        path = ZOO / f"{self.name}.py"
        numbers = [i for i, text in enumerate(path.read_text().splitlines(), 1) if text.rstrip().endswith(f"# zoo: {tag}")]
        assert len(numbers) == 1, f"{path} must mark exactly one line with '# zoo: {tag}'"
        return f"tests/run/zoo/{self.name}.py:{numbers[0]}"

    def findings(self, severity: str | None = None) -> list[dict]:
        return [f for f in self.diagnosis["findings"] if severity is None or f["severity"] == severity]

    def only_error(self) -> dict:
        errors = self.findings("error")
        assert len(errors) == 1, self.explain()
        return errors[0]

    def explain(self) -> str:
        return f"{self.name}: exit {self.returncode}\n{json.dumps(self.diagnosis, indent=1)}\n{self.output[-3000:]}"


def _run(name: str, root: Path) -> ZooRun:
    run_dir = root / name
    command = [
        sys.executable, "-m", "gradsync", "run", "--standalone", "--nproc-per-node", str(NPROC.get(name, 2)),
        "--stall-timeout", str(STALL_TIMEOUT_S), "--run-dir", str(run_dir), f"tests/run/zoo/{name}.py",
    ]
    start = time.monotonic()
    done = subprocess.run(
        command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=150,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
    )
    diagnosis_path = run_dir / "diagnosis.json"
    diagnosis = json.loads(diagnosis_path.read_text()) if diagnosis_path.exists() else {"findings": [], "missing": True}
    return ZooRun(name, done.returncode, done.stdout + done.stderr, diagnosis, time.monotonic() - start, run_dir, done.stdout)


# Healthy scripts that print, run under plain torchrun too: what they print must be the same.
SAME_AS_TORCHRUN = ["healthy_objects", "healthy_p2p_and_functional"]


def _plain_torchrun(name: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(NPROC.get(name, 2)),
        f"tests/run/zoo/{name}.py",
    ]
    return subprocess.run(
        command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=150,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
    )


@pytest.fixture(scope="session")
def under_torchrun() -> dict[str, subprocess.CompletedProcess]:
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(SAME_AS_TORCHRUN, pool.map(_plain_torchrun, SAME_AS_TORCHRUN)))


@pytest.fixture(scope="session")
def zoo(tmp_path_factory) -> dict[str, ZooRun]:
    root = tmp_path_factory.mktemp("zoo")
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = list(pool.map(lambda name: _run(name, root), BROKEN + HEALTHY))
    return {run.name: run for run in runs}


@pytest.mark.parametrize("name", HEALTHY)
def test_healthy_scripts_get_no_findings(zoo, name):
    run = zoo[name]
    assert run.returncode == 0, run.explain()
    assert run.diagnosis["status"] == "ok" and run.findings() == [], run.explain()
    ranks = NPROC.get(name, 2)
    assert f"gradsync run: ok: {ranks} rank{'s' if ranks > 1 else ''} finished" in run.output
    assert "FAILED" not in run.output and "warning:" not in run.output, run.explain()


def _script_lines(stdout: str) -> list[str]:
    """What the script printed: gradsync's own lines (and their indented continuations) left out."""
    lines, ours = [], False
    for line in stdout.splitlines():
        ours = line.startswith("gradsync run:") or (ours and line.startswith("  "))
        if not ours:
            lines.append(line)
    return sorted(lines)


@pytest.mark.parametrize("name", SAME_AS_TORCHRUN)
def test_a_healthy_script_prints_and_ends_as_under_plain_torchrun(zoo, under_torchrun, name):
    plain, run = under_torchrun[name], zoo[name]
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert run.returncode == plain.returncode, run.explain()
    assert _script_lines(run.stdout) == _script_lines(plain.stdout) != [], run.explain()


def _assert_error(run: ZooRun, category: str, ranks: list[int], locations: dict[int, str] | None = None) -> dict:
    assert run.returncode != 0, run.explain()
    assert run.diagnosis["status"] == "failed", run.explain()
    finding = run.findings("error")[0]
    assert finding["category"] == category, run.explain()
    assert finding["ranks"] == ranks, run.explain()
    for rank, tag in (locations or {}).items():
        assert finding["locations"][str(rank)] == run.line(tag), run.explain()
    assert f"FAILED: {category}" in run.output, run.explain()
    return finding


def test_uneven_batches_then_barrier(zoo):
    run = zoo["uneven_batches_barrier"]
    finding = _assert_error(run, "collective_mismatch", [1], {0: "backward", 1: "barrier"})
    assert finding["collective"] == "all_reduce/barrier"
    assert "waiting in barrier" in run.diagnosis["ranks"]["1"]


def test_barrier_inside_rank0_branch(zoo):
    _assert_error(zoo["barrier_inside_rank0"], "collective_mismatch", [0], {0: "barrier", 1: "backward"})


def test_metric_all_reduce_on_rank0_only(zoo):
    _assert_error(zoo["metric_allreduce_rank0"], "collective_mismatch", [0], {0: "metric_all_reduce", 1: "backward"})


def test_rank_dependent_branch(zoo):
    _assert_error(zoo["rank_dependent_branch"], "collective_mismatch", [0, 1], {0: "broadcast", 1: "all_reduce"})


def test_all_gather_with_different_shapes(zoo):
    finding = _assert_error(zoo["allgather_shape_mismatch"], "shape_mismatch", [0, 1], {0: "all_gather", 1: "all_gather"})
    assert "float32[4]" in finding["message"] and "float32[5]" in finding["message"]


def test_continue_past_a_bad_batch_on_one_rank(zoo):
    run = zoo["continue_bad_batch"]
    _assert_error(run, "rank_exited", [1])
    assert "consequence" in run.diagnosis["ranks"]["0"] or "waiting" in run.diagnosis["ranks"]["0"], run.explain()


def test_early_stop_on_one_rank(zoo):
    run = zoo["early_stop_alone"]
    finding = _assert_error(run, "rank_exited", [0])
    assert finding["locations"]["1"] == run.line("backward"), run.explain()


def test_bn_eval_through_the_wrapper_on_rank0_is_a_desync_even_though_it_exits_0(zoo):
    run = zoo["bn_eval_rank0"]
    finding = _assert_error(run, "desync", [0], {0: "eval_forward", 1: "train_forward"})
    assert "eval, no_grad" in finding["message"]


def test_killed_worker(zoo):
    run = zoo["killed_worker"]
    finding = _assert_error(run, "rank_crashed", [1])
    assert "SIGKILL" in finding["message"]
    assert "consequence" in finding["message"]


def test_exception_on_one_rank_names_it_and_labels_the_others_consequences(zoo):
    run = zoo["raise_on_rank1"]
    finding = _assert_error(run, "rank_crashed", [1], {1: "raise"})
    assert "ValueError: corrupt sample 17 in shard 1" in finding["message"]
    assert run.diagnosis["ranks"]["1"].startswith("failed first: ValueError")
    assert not run.diagnosis["ranks"]["0"].startswith("failed first"), run.explain()


def test_unused_parameter_crash_names_the_parameters(zoo):
    run = zoo["unused_parameter"]
    assert run.returncode != 0, run.explain()
    finding = run.findings("error")[0]
    assert finding["category"] == "unused_parameters", run.explain()
    assert finding["details"]["parameters"] == ["unused_head.weight", "unused_head.bias"], run.explain()


def test_unused_parameters_with_find_unused_is_a_warning(zoo):
    run = zoo["unused_parameter_find"]
    assert run.returncode == 0 and run.diagnosis["status"] == "ok", run.explain()
    (finding,) = run.findings()
    assert finding["category"] == "unused_parameters" and finding["severity"] == "warning"
    assert finding["details"]["parameters"] == ["unused_head.weight", "unused_head.bias"]


def test_nan_on_one_rank_is_traced_to_that_rank_and_step(zoo):
    run = zoo["nan_on_rank1"]
    assert run.returncode == 0, run.explain()
    (finding,) = [f for f in run.findings() if f["category"] == "nonfinite_gradients"]
    assert finding["ranks"] == [1] and finding["step"] == 4, run.explain()
    assert finding["locations"]["1"] == run.line("backward")


def test_straggler(zoo):
    run = zoo["straggler"]
    assert run.returncode == 0, run.explain()
    (finding,) = run.findings()
    assert finding["category"] == "straggler" and finding["ranks"] == [1], run.explain()
    assert finding["severity"] == "warning"


def test_rank_stuck_outside_collectives(zoo):
    run = zoo["stuck_rank"]
    _assert_error(run, "rank_stuck", [0], {0: "sleep", 1: "barrier"})


def test_a_deadlocked_data_loader_worker_is_named_and_stopped_with_its_rank(zoo):
    run = zoo["dataloader_worker_hang"]
    _assert_error(run, "rank_stuck", [1], {0: "backward", 1: "next_batch"})
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if "zoo/dataloader_worker_hang.py" in " ".join(p.info["cmdline"] or [])]
    assert left == [], "the ranks' DataLoader workers are stopped with them (the deadlocked one never exits alone)"


def test_a_users_own_timeout_error_is_the_cause_though_its_words_sound_like_the_network(zoo):
    run = zoo["user_timeout_error"]
    finding = _assert_error(run, "rank_crashed", [1], {1: "raise"})
    assert "TimeoutError: timed out reading shard 3" in finding["message"]
    assert run.diagnosis["ranks"]["0"].startswith("failed as a consequence"), run.explain()


def test_a_gloo_timeout_in_a_barrier_names_the_rank_that_never_came(zoo):
    run = zoo["timeout_waiting_for_poller"]
    _assert_error(run, "rank_stuck", [1], {0: "barrier", 1: "poll"})
    assert run.diagnosis["ranks"]["0"].startswith("failed as a consequence"), run.explain()


def test_an_extra_collective_that_paired_silently_is_named_not_where_the_mismatch_surfaced(zoo):
    run = zoo["extra_scalar_all_reduce"]
    finding = _assert_error(run, "collective_mismatch", [0], {0: "log_all_reduce", 1: "eval_all_reduce"})
    assert "rank 0 had called an extra collective" in finding["message"], run.explain()


def test_a_skipped_send_is_two_ranks_waiting_for_each_other_not_a_hang(zoo):
    run = zoo["skipped_send"]
    finding = _assert_error(run, "collective_mismatch", [0, 1], {0: "metric", 1: "recv"})
    assert "rank 1 waits in recv" in finding["message"] and "for rank 0" in finding["message"], run.explain()


def test_ranks_blocked_in_different_groups_are_named_with_their_lines(zoo):
    _assert_error(zoo["subgroup_vs_default"], "collective_mismatch", [0, 1], {0: "subgroup", 1: "monitored_barrier"})


def test_a_rank0_only_full_tensor_is_named_though_dtensor_collectives_are_not_recorded(zoo):
    # gradsync's recorder does not see the DTensor's all_gather; Flight Recorder does.
    run = zoo["full_tensor_on_rank0"]
    finding = _assert_error(run, "collective_mismatch", [0, 1], {0: "full_tensor", 1: "barrier"})
    assert "all_gather" in finding["message"] and "Flight Recorder" in finding["message"], run.explain()


def test_crash_after_the_script_finished_is_a_teardown_failure(zoo):
    run = zoo["teardown_crash"]
    assert run.returncode == 0, run.explain()
    (finding,) = run.findings()
    assert finding["category"] == "teardown_failure" and finding["ranks"] == [1], run.explain()
    assert "SIGABRT" in finding["message"]


def test_stall_is_diagnosed_within_the_timeout_plus_10_seconds(zoo):
    run = zoo["timed_hang"]
    _assert_error(run, "collective_mismatch", [1], {1: "barrier"})
    hang_started = float(next(line.split()[-1] for line in run.output.splitlines() if "HANG STARTS AT" in line))
    diagnosed = (run.run_dir / "diagnosis.json").stat().st_mtime
    assert 0 < diagnosed - hang_started <= STALL_TIMEOUT_S + 10, diagnosed - hang_started
    # ... and the job is over long before Gloo's 30-minute timeout.
    assert run.seconds < 60


def test_every_failure_writes_a_readable_terminal_block(zoo):
    for name in ("uneven_batches_barrier", "raise_on_rank1"):
        run = zoo[name]
        block = run.output[run.output.index("gradsync run: FAILED") :]
        lines = block.splitlines()
        assert lines[0].startswith("gradsync run: FAILED: ")
        assert any(line.strip().startswith("rank 0:") for line in lines)
        assert any(line.strip().startswith("rank 1:") for line in lines)
        assert any(line.strip().startswith("fix:") for line in lines)
        assert any("diagnosis.json" in line for line in lines)


def test_module_mode_runs_a_script_as_a_module(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "gradsync", "run", "--standalone", "--nproc-per-node", "2", "--run-dir",
         str(tmp_path / "run"), "-m", "tests.run.zoo.healthy_join"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads((tmp_path / "run" / "diagnosis.json").read_text())["status"] == "ok"


def test_options_torchrun_cannot_diagnose_are_refused(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "gradsync", "run", "--no-python", "--run-dir", str(tmp_path), "true"],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 2 and "--no-python" in done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "gradsync", "run", "--stall-timeout", "0.1", "--run-dir", str(tmp_path), "x.py"],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 2 and "at least 1 second" in done.stderr
