"""`gradsync run` on a zoo of broken and healthy unmodified scripts (tests/run/zoo), 2 processes each.

The scripts in LIVE run once per session under the real launcher (torchrun's agent, Gloo), three
at a time; the tests then read each run's diagnosis.json and terminal output. They are the ways a
job ends that only a launched run shows: exit codes, the terminal, ranks stopped and cleaned up,
how soon a hang is stopped, what plain torchrun does with the same script.

Every other script's diagnosis is made again from its recording, tests/run/zoo_recorded/zoo/NAME.json
(tests/run/recordings.py): a launched zoo script costs ~20 s of CPU, and the zoo launched whole
was a third of `make test`'s CPU, while its diagnoses are pure functions of what was recorded.
`make test-zoo` launches every script (--zoo=live); `make zoo-record` launches them all and
records them again (--zoo=record).

Lines are found by their `# zoo: <tag>` markers, so the assertions name the exact line a user
would fix.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
import torch

from gradsync.doctor import script as script_check
from gradsync.run.analysis.evidence import Evidence, read_evidence
from gradsync.run.analysis.last_words import LastWords, read_last_words
from gradsync.rundir import RunDir
from tests.conftest import ZOO_OPTION
from tests.harness import REPO_ROOT, fixture_timeout_s
from tests.run import user_view
from tests.run.recordings import Runs, assert_every_field_recorded, is_current, keep, launched_names, record, recording, remade
from tests.run.user_view import UserView, differences, plain_key, recorded_plain
from tests.timed_findings import untimed, untimed_warning_lines

ZOO = Path(__file__).parent / "zoo"
STALL_TIMEOUT_S = 5
# Scripts whose job the backend's own timeout (4 s, set by the script) must end: gradsync's stall
# timeout is kept out of its way, far longer, so that the two never race on a loaded machine.
STALL_TIMEOUT_S_OF = {"timeout_waiting_for_poller": 30, "init_timeout_skipped_barrier": 30}
# Scripts whose rank keeps working while the other waits for it, without end: stopped at a busy
# timeout short enough for the suite, but over twice the stall timeout so that the note comes first.
BUSY_TIMEOUT_S = 12
EXTRA_OPTIONS_OF = {name: ["--busy-timeout", str(BUSY_TIMEOUT_S)] for name in ("endless_loop", "exit_held_by_thread", "exit_held_by_queue")}
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
    "healthy_checkpoint_files",
    "healthy_long_native_call",
    "healthy_busy_child",
    "healthy_slow_loader_workers",
    "healthy_pipeline",
    "healthy_wrapped_model_copied",
    "healthy_threads_at_exit",
    "healthy_groups_on_every_rank",
    "healthy_exit_after_queue_drained",
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
    "fsdp_skip_forward",
    "tp_skip_forward",
    "mesh_built_differently",
    "batched_p2p_skipped",
    "compiled_collective_rank0",
    "init_timeout_skipped_barrier",
    "user_connection_error",
    "send_object_list_mismatch",
    "busy_thread_masks_hang",
    "alltoall_splits_disagree",
    "broadcast_object_list_lengths",
    "hook_all_reduce_in_backward",
    "allocation_fails_rank1",
    "atexit_flush_after_peer_left",
    "safe_main_swallows",
    "endless_loop",
    "destroyed_group_then_backward",  # its verdict: tests/run/test_harmless.py
    "pipeline_stage_skips_batch",
    "pipeline_stage_skips_microbatch",
    "pipeline_microbatches_differ",
    "pipeline_schedule_differs",
    "pipeline_sequence_grows",
    "exit_held_by_thread",
    "exit_held_by_queue",
    "new_group_on_one_rank",
]
# tests/run/zoo/redteam: scripts written from public failure reports by a helper that had not read
# gradsync (see its README), with what `gradsync run` must say of each (REDTEAM_VERDICTS, below).
# Run as their author measured them: a 10 s stall timeout, over rank1_io_sleep_barrier's 8 s
# sleep; the endless spinners stopped at a 30 s busy timeout.
REDTEAM = sorted(path.stem for path in (ZOO / "redteam").glob("*.py"))
ALL = BROKEN + HEALTHY + [f"redteam/{name}" for name in REDTEAM]
STALL_TIMEOUT_S_OF.update({f"redteam/{name}": 10 for name in REDTEAM})
EXTRA_OPTIONS_OF.update({f"redteam/{name}": ["--busy-timeout", "30"] for name in ("spin_convergence", "spin_rebalance_sampler")})
NPROC.update({f"redteam/{name}": 3 for name in REDTEAM if (ZOO / "redteam" / f"{name}.py").read_text().startswith("# nproc: 3")})
# Launched by `make test` (the rest are re-diagnosed from their recordings): healthy runs whose
# files are compared with plain torchrun's or whose ranks work while others wait (the busy notes);
# failures whose exit code, terminal block, timing or clean-up is checked.
LIVE = [
    "healthy_checkpoint_files",
    "healthy_wrapped_model_copied",
    "healthy_long_native_call",
    "healthy_busy_child",
    "healthy_slow_loader_workers",
    "atexit_flush_after_peer_left",
    "raise_on_rank1",
    "teardown_crash",
    "stuck_rank",
    "endless_loop",
    "dataloader_worker_hang",
    "busy_thread_masks_hang",
    "timed_hang",
    "exit_held_by_queue",  # the launcher's own reading of a rank whose exit record is written and whose process lives on
]
# Each zoo job's hang guard; the session's `zoo` fixture runs them AT_A_TIME at a time.
RUN_TIMEOUT_S = 150
AT_A_TIME = 3
# The fixture runs inside whichever test asks for it first, so that test's guard is the one its
# runs' own guards add up to: ~300 s quiet, ~1,230 s on a 2-core machine at load 15, where the
# former 900 s ran out (its runs took 22-63 s each, under their 150 s).
pytestmark = [pytest.mark.launches, pytest.mark.timeout(fixture_timeout_s(len(ALL), AT_A_TIME, RUN_TIMEOUT_S))]
# Scripts that write files into the folder given as `--out DIR`: a folder of their own under
# `gradsync run` and under plain torchrun, so the two can be compared.
WRITES_FILES = ["healthy_checkpoint_files"]


def _script_args(name: str, root: Path) -> list[str]:
    return ["--out", str(root / f"{name}.out")] if name in WRITES_FILES else []


@dataclass
class ZooRun:
    """A zoo script's run: launched (`live`), or re-diagnosed from its recording, which has no exit
    code, no run folder and, for output, the terminal block of its diagnosis alone."""

    name: str
    returncode: int | None
    output: str
    diagnosis: dict
    run_dir: Path | None
    stdout: str = ""
    evidence: Evidence | None = None
    user_view: UserView | None = None  # what its user saw (tests/run/user_view.py)

    @property
    def live(self) -> bool:
        return self.run_dir is not None

    @property
    def out_dir(self) -> Path:
        """The folder a script in WRITES_FILES wrote into (next to its run directory)."""
        return self.run_dir.parent / f"{self.name}.out"

    def line(self, tag: str) -> str:
        """'tests/run/zoo/NAME.py:LINE' of the line marked `# zoo: tag`; a tag 'MODULE:tag' marks a
        line of a module beside the script (MODULE: its path from the script's folder, without .py)."""
        module, _, tag = tag.rpartition(":")
        script = (Path(self.name).parent / module).as_posix() if module else self.name
        path = ZOO / f"{script}.py"
        numbers = [i for i, text in enumerate(path.read_text().splitlines(), 1) if text.rstrip().endswith(f"# zoo: {tag}")]
        assert len(numbers) == 1, f"{path} must mark exactly one line with '# zoo: {tag}'"
        return f"tests/run/zoo/{script}.py:{numbers[0]}"

    def findings(self, severity: str | None = None) -> list[dict]:
        """The findings, but those judged from timings (tests/timed_findings.py)."""
        return [f for f in untimed(self.diagnosis["findings"]) if severity is None or f["severity"] == severity]

    def only_error(self) -> dict:
        errors = self.findings("error")
        assert len(errors) == 1, self.explain()
        return errors[0]

    def last_words(self, rank: int) -> LastWords | None:
        """What the rank's log said last: read from the log of a launched run, else as recorded."""
        if self.live:
            return read_last_words(RunDir(self.run_dir).log(0, rank))
        return self.evidence.views[rank].last_words

    def explain(self) -> str:
        how = f"exit {self.returncode}" if self.live else "re-diagnosed from its recording"
        return f"{self.name}: {how}\n{json.dumps(self.diagnosis, indent=1)}\n{self.output[-3000:]}"


def _options(name: str) -> list[str]:
    """The launcher options the script runs with (its run folder aside)."""
    return ["--nproc-per-node", str(NPROC.get(name, 2)), "--stall-timeout", str(STALL_TIMEOUT_S_OF.get(name, STALL_TIMEOUT_S)),
            *EXTRA_OPTIONS_OF.get(name, [])]


def _run(name: str, root: Path) -> ZooRun:
    run_dir = root / name
    command = [
        sys.executable, "-m", "gradsync", "run", "--standalone", *_options(name),
        "--run-dir", str(run_dir), f"tests/run/zoo/{name}.py",
        *_script_args(name, root),
    ]
    done = subprocess.run(
        command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
    )
    diagnosis_path = run_dir / "diagnosis.json"
    diagnosis = json.loads(diagnosis_path.read_text()) if diagnosis_path.exists() else {"findings": [], "missing": True}
    evidence = read_evidence(RunDir(run_dir).attempt_evidence(0))
    logs = {rank: RunDir(run_dir).log(0, rank) for rank in range(NPROC.get(name, 2))}
    seen = user_view.gradsync(evidence, {rank: log.read_text(errors="replace") for rank, log in logs.items() if log.exists()},
                              done.stdout) if evidence else None
    return ZooRun(name, done.returncode, done.stdout + done.stderr, diagnosis, run_dir, done.stdout, evidence, seen)


# Scripts launched under plain torchrun too in every session: what they write, and the words of
# an exit handler's failure, are compared with gradsync run's (what every script prints and how
# each rank ends is compared with plain torchrun's recorded run, in the differential test below).
SAME_AS_TORCHRUN = ["healthy_checkpoint_files", "atexit_flush_after_peer_left"]


@dataclass
class PlainRun:
    returncode: int
    stdout: str
    stderr: str
    out_dir: Path


# The scripts compared here exit 0 under plain torchrun. A reference run that did not says nothing
# of gradsync: Gloo's teardown race (../shared/README.md) can abort a torch-only script after its
# last line, and on a loaded machine torchrun's own rendezvous can fail (once in CI, exit 1 with no
# word from the script). So a failed reference run is run again, at most twice, and the test then
# shows what it printed.
def _plain_torchrun(name: str, root: Path) -> PlainRun:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(NPROC.get(name, 2)),
        f"tests/run/zoo/{name}.py", *_script_args(name, root),
    ]
    for _ in range(3):
        done = subprocess.run(
            command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
            env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
        )
        if done.returncode == 0:
            break
    return PlainRun(done.returncode, done.stdout, done.stderr, root / f"{name}.out")


@pytest.fixture(scope="session")
def under_torchrun(tmp_path_factory) -> dict[str, PlainRun]:
    root = tmp_path_factory.mktemp("torchrun")
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(SAME_AS_TORCHRUN, pool.map(lambda name: _plain_torchrun(name, root), SAME_AS_TORCHRUN)))


def _recording(name: str) -> tuple[str, Path, list[str]]:
    """The script's recording: its key, its script and the options it runs with."""
    return f"zoo/{name}", ZOO / f"{name}.py", _options(name)


def _recorded(name: str) -> ZooRun:
    """The script's run as its recording has it: its diagnosis made again by the current rules."""
    evidence, diagnosis, output = remade(*_recording(name))
    seen = recording(*_recording(name)).get("user_view")
    return ZooRun(name, None, output, diagnosis, None, evidence=evidence, user_view=UserView.from_dict(seen) if seen else None)


@pytest.fixture(scope="session")
def zoo(request, tmp_path_factory) -> Runs:
    mode = request.config.getoption(ZOO_OPTION)
    root = tmp_path_factory.mktemp("zoo")
    # Three at a time on two cores: half the scripts spend STALL_TIMEOUT_S blocked in a hang.
    with ThreadPoolExecutor(max_workers=AT_A_TIME) as pool:
        runs = list(pool.map(lambda name: _run(name, root), launched_names(mode, ALL, LIVE)))
    if mode == "record":
        for run in runs:
            record(*_recording(run.name), run.run_dir, run.user_view.as_dict() if run.user_view else None)
    return Runs({run.name: run for run in runs}, ALL, _recorded)


# -- the differential test: what the user sees, under plain torchrun and under gradsync run ------------
#
# Plain torchrun's side does not depend on gradsync: it is recorded once per version of a script
# (and of torch), in zoo_recorded/torchrun, by `make zoo-record` where it is missing or stale.
# A job gradsync stopped as hung is given PLAIN_HANG_BOUND_S under torchrun, which would wait for
# Gloo's 30 minutes; one still running then is hung there (a healthy script ends in 10-40 s).
PLAIN_HANG_BOUND_S = 60


def _plain_view(name: str, bound_s: float, root: Path) -> UserView:
    logs = root / name / "logs"
    seen = user_view.torchrun_twice(f"tests/run/zoo/{name}.py", NPROC.get(name, 2), _script_args(name, root / name), REPO_ROOT, logs, bound_s)
    keep(*plain_key(name, NPROC.get(name, 2)), {"user_view": seen.as_dict()})
    return seen


@pytest.fixture(scope="session")
def plain_views(request, zoo, tmp_path_factory) -> dict[str, UserView]:
    """Each zoo script's run under plain torchrun, as recorded (launched and recorded first under
    --zoo=record where its recording is missing or stale)."""
    if request.config.getoption(ZOO_OPTION) == "record":
        stale = [name for name in ALL if not is_current(*plain_key(name, NPROC.get(name, 2)))]
        root = tmp_path_factory.mktemp("plain")
        bounds = {name: PLAIN_HANG_BOUND_S if zoo[name].evidence.trigger == "stall" else RUN_TIMEOUT_S for name in stale}
        with ThreadPoolExecutor(max_workers=AT_A_TIME) as pool:
            list(pool.map(lambda name: _plain_view(name, bounds[name], root), stale))
    return Runs({}, ALL, lambda name: recorded_plain(name, NPROC.get(name, 2)))


# Scripts that print a duration: two quiet runs under torchrun may print the same, and a run on a
# loaded machine another (their output is then compared by the ranks' ends alone, as for any script
# whose two torchrun runs printed otherwise).
PRINTS_DURATIONS = {"redteam/slow_worker_init_loader": "how long its first batch took, in seconds"}


@pytest.mark.parametrize("name", ALL)
def test_each_rank_ends_and_the_script_prints_as_under_plain_torchrun(zoo, plain_views, name):
    """Each rank's exit code, the last exception its stderr shows (type and zoo line) and, in a
    run where every rank ended well, what the script printed: the same under gradsync run as
    under plain torchrun, but for the differences docs/run.md lists (user_view.differences)."""
    run = zoo[name]
    assert run.user_view is not None, f"{name}'s recording has no user view: run `make zoo-record`"
    plain = plain_views[name]
    if name in PRINTS_DURATIONS:
        plain = UserView(plain.ranks, None)
    assert differences(plain, run.user_view) == [], run.explain()


def test_the_launched_scripts_are_zoo_scripts():
    assert set(LIVE) <= set(ALL) and len(set(LIVE)) == len(LIVE)


@pytest.mark.parametrize("name", sorted(set(ALL) - set(LIVE)))
def test_a_script_not_launched_has_a_recording_of_its_current_version(zoo, name):
    run = zoo[name]  # a missing or stale recording fails here, naming `make zoo-record`
    assert run.live or run.evidence is not None


@pytest.mark.parametrize("name", LIVE)
def test_a_launched_runs_diagnosis_is_made_again_from_what_it_kept(zoo, name):
    """The evidence a run keeps is all its diagnosis was made from: made again, it is the same."""
    run = zoo.launched(name)
    evidence = read_evidence(RunDir(run.run_dir).attempt_evidence(0))
    assert evidence is not None, run.explain()
    again = evidence.diagnose(script_check)
    for key in ("status", "trigger", "findings", "ranks"):
        assert again[key] == run.diagnosis[key], (key, again[key], run.explain())


def test_the_recordings_have_every_field_the_ranks_record_now(zoo):
    assert_every_field_recorded(zoo, "zoo")


@pytest.mark.parametrize("name", HEALTHY)
def test_healthy_scripts_get_no_findings(zoo, name):
    run = zoo[name]
    assert not run.live or run.returncode == 0, run.explain()
    assert run.diagnosis["status"] == "ok" and run.findings() == [], run.explain()
    ranks = NPROC.get(name, 2)
    assert f"gradsync run: ok: {ranks} rank{'s' if ranks > 1 else ''} finished" in run.output
    assert "FAILED" not in run.output and untimed_warning_lines(run.output) == [], run.explain()


def _same(a, b) -> bool:
    """Equal checkpoints: the same nesting of dicts and lists, with equal tensors and values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _written(folder: Path) -> dict[str, int]:
    return {path.relative_to(folder).as_posix(): path.stat().st_size for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.mark.parametrize("name", WRITES_FILES)
def test_a_healthy_script_writes_the_same_files_as_under_plain_torchrun(zoo, under_torchrun, name):
    plain, run = under_torchrun[name], zoo.launched(name)
    assert plain.returncode == 0 and run.returncode == 0, plain.stderr + run.explain()
    written = _written(run.out_dir)
    assert written == _written(plain.out_dir) and written, (written, _written(plain.out_dir))
    for relative in written:
        ours, theirs = run.out_dir / relative, plain.out_dir / relative
        if relative.endswith(".pt"):
            # Compared by what they hold: torch.save's archive need not be the same byte for byte.
            assert _same(torch.load(ours, weights_only=True), torch.load(theirs, weights_only=True)), relative
        else:
            assert ours.read_bytes() == theirs.read_bytes(), relative


def _assert_error(run: ZooRun, category: str, ranks: list[int], locations: dict[int, str] | None = None) -> dict:
    assert not run.live or run.returncode != 0, run.explain()
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
    finding = _assert_error(run, "rank_exited", [0], {0: "leave", 1: "backward"})
    assert f"left the process group at {run.line('leave')}" in finding["message"], run.explain()


def test_a_rank_that_swallowed_its_error_and_exited_0_is_named_not_the_rank_left_waiting(zoo):
    # Plain torchrun blames rank 0, whose backward lost its peer.
    run = zoo["safe_main_swallows"]
    _assert_error(run, "rank_exited", [1], {0: "backward", 1: "backward"})
    assert run.diagnosis["ranks"]["0"].startswith("failed as a consequence"), run.explain()


def _exit_handler_error(output: str) -> tuple[str, bool] | None:
    """The type of the error Python printed for a failed exit handler, and whether it blamed the
    peer ("Connection closed by peer", or reset)."""
    _, _, after = output.partition("Exception ignored in atexit callback")
    found = re.search(r"^(\w+): (.*)$", after, re.MULTILINE)
    return (found.group(1), "by peer" in found.group(2)) if found else None


def test_a_collective_an_exit_handler_runs_after_the_peer_left_is_a_warning_and_fails_as_without_gradsync(zoo, under_torchrun):
    run, plain = zoo.launched("atexit_flush_after_peer_left"), under_torchrun["atexit_flush_after_peer_left"]
    assert plain.returncode == 0, f"plain torchrun, three times: {plain.stderr[-3000:]}"
    assert run.returncode == 0, run.explain()
    assert run.diagnosis["status"] == "ok" and "gradsync run: ok: 2 ranks finished" in run.output, run.explain()
    (finding,) = run.findings()
    assert finding["category"] == "collective_after_peer_left" and finding["severity"] == "warning", run.explain()
    assert finding["ranks"] == [0] and finding["locations"] == {"0": run.line("exit_all_reduce")}, run.explain()
    assert "by an exit handler" in finding["message"] and "by peer" in finding["message"], run.explain()
    # The handler meets the group and the error it meets under plain torchrun: the lost peer, not a
    # group gradsync destroyed before the script's exit handlers ran.
    assert _exit_handler_error(run.output) == _exit_handler_error(plain.stderr) == ("RuntimeError", True), (
        run.explain() + plain.stderr
    )


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
    assert not run.live or run.returncode != 0, run.explain()
    finding = run.findings("error")[0]
    assert finding["category"] == "unused_parameters", run.explain()
    assert finding["details"]["parameters"] == ["unused_head.weight", "unused_head.bias"], run.explain()
    # Named where the fix usually goes, the wrapper's construction; where it stopped in the message.
    assert set(finding["locations"].values()) == {run.line("ddp_wrap")}, run.explain()
    assert f"at {run.line('forward')}" in finding["message"], run.explain()


def test_unused_parameters_with_find_unused_is_a_warning(zoo):
    run = zoo["unused_parameter_find"]
    assert not run.live or run.returncode == 0, run.explain()
    assert run.diagnosis["status"] == "ok", run.explain()
    (finding,) = run.findings()
    assert finding["category"] == "unused_parameters" and finding["severity"] == "warning"
    assert finding["details"]["parameters"] == ["unused_head.weight", "unused_head.bias"]


def test_nan_on_one_rank_is_traced_to_that_rank_and_step(zoo):
    run = zoo["nan_on_rank1"]
    assert not run.live or run.returncode == 0, run.explain()
    (finding,) = [f for f in run.findings() if f["category"] == "nonfinite_gradients"]
    assert finding["ranks"] == [1] and finding["step"] == 4, run.explain()
    assert finding["locations"]["1"] == run.line("backward")


def test_straggler(zoo):
    # Rank 1's 0.3 s sleep per step makes it late by at least that: the limit is 20% of the
    # ~0.3 s step (50 ms at least), so only a step slowed past 1.2 s of work could hide it.
    run = zoo["straggler"]
    assert not run.live or run.returncode == 0, run.explain()
    (finding,) = run.diagnosis["findings"]
    assert finding["category"] == "straggler" and finding["ranks"] == [1], run.explain()
    assert finding["severity"] == "warning"


def test_rank_stuck_outside_collectives(zoo):
    run = zoo["stuck_rank"]
    _assert_error(run, "rank_stuck", [0], {0: "sleep", 1: "barrier"})


def test_an_idle_rank_is_stopped_at_the_stall_timeout_without_a_note(zoo):
    # On a loaded machine a rank's reports can lag (a start slowed past the stall timeout, a
    # snapshot thread held up while its main thread still used CPU a moment before): a note then is
    # the clocks' honest answer. What must never be noted as work is the sleep itself.
    run = zoo.launched("stuck_rank")
    assert run.diagnosis["stopped_at"] == "stall_timeout", run.explain()
    for note in run.diagnosis.get("notes", []):
        assert run.line("sleep") not in note["working"].values(), run.explain()


def test_a_process_its_threads_keep_from_exiting_is_named_where_the_thread_was_created(zoo):
    # As under plain Python: the non-daemon thread is joined before the atexit handler that would
    # stop it, so no rank exits; noted at the stall timeout, stopped at the busy one.
    run = zoo["exit_held_by_thread"]
    finding = _assert_error(run, "exit_held_by_threads", [0, 1], {0: "thread_create", 1: "thread_create"})
    assert (f"'heartbeat' (created at {run.line('thread_create')}, started at {run.line('thread_start')}), at "
            f"{run.line('heartbeat_wait')}") in finding["message"], run.explain()
    assert "waiting on a lock or an event of another thread" in finding["message"], run.explain()



def test_a_process_an_exit_handler_keeps_from_exiting_is_named_with_what_the_handler_waits_on(zoo):
    # Past the script's threads: multiprocessing's exit handler joins a queue's feeder thread that
    # waits for good on a full pipe. Rank 0's exit record is written, its process never ends.
    run = zoo["exit_held_by_queue"]
    finding = _assert_error(run, "exit_held_by_threads", [0])
    assert "did not end after the script's exit handlers began" in finding["message"], run.explain()
    assert "_finalize_join" in finding["message"] and "a multiprocessing queue" in finding["message"], run.explain()
    assert "cancel_join_thread" in finding["suggestion"], run.explain()

def test_a_group_created_on_one_rank_only_is_named_at_its_creation_before_what_it_breaks_later(zoo):
    run = zoo["new_group_on_one_rank"]
    finding = _assert_error(run, "group_creation_mismatch", [0], {0: "eval_group", 1: "metrics_group"})
    assert "Rank 0 created a process group that the other ranks never created" in finding["message"], run.explain()
    assert "new_group(ranks=[0]) (group creation #1)" in finding["message"], run.explain()


# Healthy scripts where one rank works for 6 s of CPU (so at least 6 s, over the 5 s stall
# timeout) while the other waits in a collective: rank and tag of the line it works at.
WORKING_WHILE_OTHERS_WAIT = {
    "healthy_long_native_call": (0, "native_call"),  # one native call: its stack never moves
    "healthy_busy_child": (0, "child"),  # a child process works; the rank's own threads wait
    "healthy_slow_loader_workers": (1, "next_batch"),  # DataLoader worker processes work
}


@pytest.mark.parametrize("name", sorted(WORKING_WHILE_OTHERS_WAIT))
def test_a_rank_that_works_while_the_other_waits_is_noted_not_stopped(zoo, name):
    run = zoo.launched(name)
    rank, tag = WORKING_WHILE_OTHERS_WAIT[name]
    assert run.returncode == 0 and run.diagnosis["status"] == "ok", run.explain()
    # A note of its own (a loaded machine may add one at start-up: a rank waiting in
    # init_process_group while the other still imports torch).
    notes = [note for note in run.diagnosis.get("notes") or [] if note["working"] == {str(rank): run.line(tag)}]
    assert len(notes) == 1 and list(notes[0]["waiting"]) == [str(1 - rank)], run.explain()
    assert "gradsync run: note: no rank has made progress" in run.output, run.explain()


def test_an_endless_python_loop_is_noted_then_stopped_at_the_busy_timeout_at_its_loop(zoo):
    run = zoo.launched("endless_loop")
    finding = _assert_error(run, "rank_stuck", [1], {0: "peer_wait", 1: "loop"})
    assert run.diagnosis["stopped_at"] == "busy_timeout" and run.diagnosis["busy_timeout_s"] == BUSY_TIMEOUT_S, run.explain()
    assert f"within the loop at {run.line('loop')}" in finding["message"], run.explain()
    assert {"1": run.line("loop")} in [note["working"] for note in run.diagnosis["notes"]], run.explain()
    assert "gradsync run: note:" in run.output, run.explain()


def test_a_deadlocked_data_loader_worker_is_named_and_stopped_with_its_rank(zoo):
    run = zoo.launched("dataloader_worker_hang")
    finding = _assert_error(run, "rank_stuck", [1], {0: "backward", 1: "next_batch"})
    # Its worker processes, read from outside: the deadlocked one at its __getitem__'s wait.
    assert f"at {run.line('deadlock')}, not running" in finding["message"], run.explain()
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if "zoo/dataloader_worker_hang.py" in " ".join(p.info["cmdline"] or [])]
    assert left == [], "the ranks' DataLoader workers are stopped with them (the deadlocked one never exits alone)"


def test_a_users_own_timeout_error_is_the_cause_though_its_words_sound_like_the_network(zoo):
    run = zoo["user_timeout_error"]
    finding = _assert_error(run, "rank_crashed", [1], {1: "raise"})
    assert "TimeoutError: timed out reading shard 3" in finding["message"]
    _assert_a_consequence_waiting_at(run, 0, "backward", cause=1)


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


# -- pipelines (torch.distributed.pipelining): named by stage, step and micro-batch, and by which
# of the invariants their stages share was broken (gradsync.run.analysis.pipelines)


def test_a_pipeline_stage_that_skips_a_batch_is_named_by_the_steps_each_stage_ran(zoo):
    run = zoo["pipeline_stage_skips_batch"]
    finding = _assert_error(run, "pipeline_steps_differ", [1], {0: "first_stage", 1: "last_stage"})
    assert "stage 1 (rank 1) ran 4 steps of its schedule and finished the script, while stage 0 (rank 0) is in step 5" in finding["message"], run.explain()
    assert "micro-batch 1 of 4's activations to stage 1" in finding["message"], run.explain()


def test_a_pipeline_stage_that_skips_a_micro_batch_is_named_where_the_stages_orders_part(zoo):
    run = zoo["pipeline_stage_skips_microbatch"]
    # Named at the lines of the hand-written schedule where each waits (the script's own code).
    finding = _assert_error(run, "pipeline_microbatch_skipped", [0], {0: "bwd_recv", 1: "fwd_recv"})
    assert ("In step 2, stage 0 (rank 0) went past micro-batch 2's activations without sending it (stage 0 (rank 0) "
            "sent micro-batches 0, 1, 3; stage 1 (rank 1) received 0, 1, 2 and waits for 3)") in finding["message"], run.explain()


def test_pipeline_stages_built_for_different_micro_batch_counts_explain_the_loss_error_it_caused(zoo):
    run = zoo["pipeline_microbatches_differ"]
    finding = _assert_error(run, "pipeline_microbatch_mismatch", [0, 1], {0: "first_stage", 1: "last_stage"})
    assert "stage 0 (rank 0) 4, stage 1 (rank 1) 8" in finding["message"], run.explain()
    assert "raised ValueError: Expected input batch_size (4) to match target batch_size (2)" in finding["message"], run.explain()


def test_pipeline_stages_running_different_schedules_are_named_with_both(zoo):
    run = zoo["pipeline_schedule_differs"]
    finding = _assert_error(run, "pipeline_schedule_mismatch", [0, 1], {0: "first_stage", 1: "last_stage"})
    assert "stage 0 (rank 0) ScheduleGPipe, stage 1 (rank 1) Schedule1F1B" in finding["message"], run.explain()


def test_a_pipeline_batch_of_another_shape_is_named_by_both_shapes_and_its_step(zoo):
    run = zoo["pipeline_sequence_grows"]
    finding = _assert_error(run, "pipeline_shape_mismatch", [0, 1], {0: "first_stage", 1: "last_stage"})
    assert "In step 3, stage 0 (rank 0) sent micro-batch 0's activations as float32[2, 9, 16]" in finding["message"], run.explain()
    assert "stage 1 (rank 1) expected float32[2, 6, 16] (it received 1152 bytes where it had posted room for 768)" in finding["message"], run.explain()


def test_ranks_blocked_in_different_groups_are_named_with_their_lines(zoo):
    _assert_error(zoo["subgroup_vs_default"], "collective_mismatch", [0, 1], {0: "subgroup", 1: "monitored_barrier"})


def test_a_rank0_only_full_tensor_is_named_though_dtensor_collectives_are_not_recorded(zoo):
    # gradsync's recorder does not see the DTensor's all_gather; Flight Recorder does. Rank 1 stands
    # past the line of rank 0's all_gather in the same function, having made as many collectives:
    # rank 0 is the one whose path went its own way.
    run = zoo["full_tensor_on_rank0"]
    finding = _assert_error(run, "collective_mismatch", [0], {0: "full_tensor", 1: "barrier"})
    assert "all_gather" in finding["message"] and "Flight Recorder" in finding["message"], run.explain()
    assert "Their paths parted in main" in finding["message"], run.explain()


def test_an_fsdp_rank_that_skips_a_forward_is_named_at_its_all_gather(zoo):
    # FSDP2's all-gathers pass through torch.distributed: the recorder sees them, at the user's forward.
    run = zoo["fsdp_skip_forward"]
    # Rank 1 ran one forward fewer: its barrier is at a line rank 0 never reached, off the path
    # both share, where rank 0's all-gather is one rank 1 made at every earlier step. It stands past
    # the training loop rank 0 is still in: named at the condition of the loop's `continue`, the
    # line above the one marked "skip".
    finding = _assert_error(run, "collective_mismatch", [1], {0: "forward"})
    path, line = run.line("skip").rsplit(":", 1)
    assert finding["locations"]["1"] == f"{path}:{int(line) - 1}", run.explain()
    assert finding["collective"] == "all_gather_single/barrier", run.explain()
    assert "rank 1 had left the loop" in finding["message"], run.explain()


def test_a_tensor_parallel_rank_that_skips_a_forward_is_named_though_dtensor_collectives_are_not_recorded(zoo):
    # DTensor's all-reduce is a functional collective: Flight Recorder numbers it as the group does.
    run = zoo["tp_skip_forward"]
    finding = _assert_error(run, "collective_mismatch", [0, 1], {0: "forward", 1: "barrier"})
    assert "all_reduce" in finding["message"] and "Flight Recorder" in finding["message"], run.explain()


def test_device_meshes_built_differently_are_the_cause_whatever_hung(zoo):
    run = zoo["mesh_built_differently"]
    finding = _assert_error(run, "collective_mismatch", [0, 1], {0: "mesh", 1: "mesh"})
    assert "built different device meshes" in finding["message"], run.explain()
    assert "rank 0: shape (1, 2) ('dp', 'tp')" in finding["message"] and "rank 1: shape (2, 1)" in finding["message"]
    assert finding["suggestion"].startswith("Build every device mesh from values all ranks share")


def test_a_skipped_batch_isend_irecv_is_two_ranks_waiting_for_each_other_not_a_hang(zoo):
    run = zoo["batched_p2p_skipped"]
    finding = _assert_error(run, "collective_mismatch", [0, 1], {0: "metric"})
    # Rank 1 is blocked on the requests of the batch it issued: either line names that batch.
    assert finding["locations"]["1"] in (run.line("batch_isend_irecv"), run.line("wait")), run.explain()
    assert "for rank 0" in finding["message"], run.explain()


def test_a_collective_inside_a_compiled_function_called_by_one_rank_is_a_mismatch(zoo):
    # Dynamo puts the all_reduce in the graph, a functional collective gradsync's recorder does
    # not see (Flight Recorder does).
    run = zoo["compiled_collective_rank0"]
    finding = _assert_error(run, "collective_mismatch", [0, 1], {1: "barrier"})
    assert "all_reduce" in finding["message"], run.explain()


@pytest.mark.xfail(
    reason="rank 0's location is the compiled forward's `def` line, not its all_reduce: the Python "
    "frame Dynamo runs the graph from reports the function's first line",
    strict=True,
    raises=AssertionError,
)
def test_a_collective_inside_a_compiled_function_is_named_by_its_line(zoo):
    _assert_error(zoo["compiled_collective_rank0"], "collective_mismatch", [0, 1], {0: "compiled_all_reduce", 1: "barrier"})


def test_a_gloo_timeout_in_a_barrier_names_the_rank_that_skipped_it(zoo):
    run = zoo["init_timeout_skipped_barrier"]
    finding = _assert_error(run, "rank_stuck", [1], {0: "barrier"})
    # Rank 1 is caught inside tokenize's busy loop: on its body or, now and then, on the loop's
    # own `while` line just above it (seen once in CI); either line names the loop.
    path, line = run.line("tokenize").rsplit(":", 1)
    assert finding["locations"]["1"] in (f"{path}:{line}", f"{path}:{int(line) - 1}"), run.explain()
    assert run.diagnosis["ranks"]["0"].startswith("failed as a consequence"), run.explain()
    # Gloo's own timeout ended the job, 26 s before gradsync's stall timeout (STALL_TIMEOUT_S_OF) could.
    assert run.diagnosis["trigger"] == "failure", run.explain()


def test_a_users_own_connection_error_is_the_cause_not_the_network(zoo):
    run = zoo["user_connection_error"]
    finding = _assert_error(run, "rank_crashed", [0], {0: "raise"})
    assert "ConnectionError: connection refused by feature store at 10.0.0.5:6379" in finding["message"]
    _assert_a_consequence_waiting_at(run, 1, "backward", cause=0)


def _assert_a_consequence_waiting_at(run, rank, marker, cause):
    """The rank left waiting for a crashed peer ends one of two ways, whichever comes first: the
    backend's "connection closed" error, or the launcher's SIGTERM once the peer has failed (CI
    under load saw the second). Either way it is a consequence, named at the line it waited on."""
    state = run.diagnosis["ranks"][str(rank)]
    assert state.startswith(("failed as a consequence", f"stopped by the launcher (SIGTERM) once rank {cause} had failed")), run.explain()
    assert run.line(marker) in state, run.explain()


def test_an_unreceived_send_object_list_is_named_with_the_barrier_it_waits_against(zoo):
    run = zoo["send_object_list_mismatch"]
    finding = _assert_error(run, "collective_mismatch", [0, 1], {0: "send_done", 1: "barrier"})
    assert "for rank 1" in finding["message"], run.explain()


def _printed_times(run: ZooRun, marker: str) -> list[float]:
    return [float(line.split()[-1]) for line in run.output.splitlines() if marker in line]


def test_a_hang_under_a_busy_thread_is_diagnosed_at_the_stall_timeout(zoo):
    # The prefetcher threads' CPU is not progress while the main threads wait in collectives.
    run = zoo.launched("busy_thread_masks_hang")
    _assert_error(run, "collective_mismatch", [0], {0: "barrier", 1: "backward"})
    assert run.diagnosis["trigger"] == "stall", run.explain()
    diagnosed = (run.run_dir / "diagnosis.json").stat().st_mtime
    # The prefetchers work for 60 s, over 8x the ~7 s from their start to the diagnosis; a rank
    # stopped before then never prints that they stopped.
    stopped = _printed_times(run, "PREFETCHER STOPS AT")
    assert not stopped or diagnosed < min(stopped), (_printed_times(run, "HANG STARTS AT"), diagnosed, stopped)


def test_crash_after_the_script_finished_is_a_teardown_failure(zoo):
    run = zoo.launched("teardown_crash")
    assert run.returncode == 0, run.explain()
    (finding,) = run.findings()
    assert finding["category"] == "teardown_failure" and finding["ranks"] == [1], run.explain()
    assert "SIGABRT" in finding["message"]


def test_stall_is_diagnosed_within_the_timeout_plus_10_seconds(zoo):
    run = zoo.launched("timed_hang")
    _assert_error(run, "collective_mismatch", [1], {1: "barrier"})
    hang_started = float(next(line.split()[-1] for line in run.output.splitlines() if "HANG STARTS AT" in line))
    diagnosed = (run.run_dir / "diagnosis.json").stat().st_mtime
    # The margin is over 5x what the diagnosis takes past the timeout (~1 s: the last snapshot,
    # a poll, stopping the ranks), and the ranks were stopped by it, not by Gloo's 30-minute timeout.
    assert 0 < diagnosed - hang_started <= STALL_TIMEOUT_S + 10, diagnosed - hang_started
    assert run.diagnosis["trigger"] == "stall", run.explain()


def test_every_failure_writes_a_readable_terminal_block(zoo):
    for name in ("stuck_rank", "raise_on_rank1"):  # without a traceback, and with one
        run = zoo.launched(name)
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


def test_every_run_gets_a_report_that_leads_with_what_went_wrong(zoo):
    """Per class, over the launched runs: a failed run's page opens with the diagnosis (before any
    plot), quotes each named line of the user's script and lists each rank's last collectives;
    a healthy run's page opens with its plots. Advice lines end only a healthy `gradsync run`."""
    from gradsync.report import write_report
    from gradsync.rundir import read_ring
    from tests.report.browser import CHROMIUM, open_in_chromium

    measured = set()  # the first failed and the first healthy page are also laid out by Chromium
    for run in zoo.live_runs():
        if run.diagnosis.get("missing"):
            continue
        page = write_report(run.run_dir, run.run_dir.parent / f"{run.name}.report.html")[0]
        html = page.read_text()
        if CHROMIUM is not None and run.diagnosis["status"] not in measured:  # the findings, quotes and last collectives fit the window
            measured.add(run.diagnosis["status"])
            assert 'data-wider-than-window="false"' in open_in_chromium(page), f"{run.name}: the page runs off the right edge"
        first_plot = html.find("<img")
        diagnosis_at = html.index("<h2>Diagnosis</h2>")
        advice_printed = "gradsync run: advice:" in run.output
        if run.diagnosis["status"] == "ok":
            assert first_plot == -1 or first_plot < diagnosis_at, run.name
            continue
        assert not advice_printed, f"{run.name}: a failed run's advice is its diagnosis"
        assert first_plot == -1 or diagnosis_at < first_plot, run.name
        for finding in run.findings("error"):
            for location in finding.get("locations", {}).values():
                path, _, line = location.rpartition(":")
                if path.startswith("tests/run/zoo/"):
                    assert re.search(rf"<span class='mark'>\s*{line} \| ", html), f"{run.name}: {location} is not quoted"
        if "<pre id='last-collectives'>" not in html:
            latest = max(run.run_dir.glob("workers/attempt*"), key=lambda p: int(p.name[7:]))
            recorded = [p for p in latest.glob("rank*.ring") if read_ring(p)]  # the ring file is preallocated
            assert not recorded, f"{run.name}: ranks recorded collectives, but the page does not list their last ones"


# -- the backend's last words (gradsync.run.analysis.last_words), from real Gloo aborts ------------


def test_all_to_all_splits_that_disagree_are_a_shape_mismatch_naming_the_pair(zoo):
    run = zoo["alltoall_splits_disagree"]
    finding = _assert_error(run, "shape_mismatch", [0, 1], {0: "a2a", 1: "a2a"})
    assert "rank 1 sends 3 rows to rank 0, which expects 2" in finding["message"], run.explain()
    # The words Gloo printed as it aborted rank 0, as the rank's log kept them.
    words = run.last_words(0)
    assert words.family == "collective_mismatch", words
    assert (words.details["received_bytes"], words.details["expected_bytes"]) == (48, 32), words
    assert finding["details"]["last_words"]["0"]["received_bytes"] == 48
    assert "SIGKILL" not in finding["message"] and "OOM" not in finding["message"]


def test_object_lists_of_different_lengths_are_a_shape_mismatch(zoo):
    run = zoo["broadcast_object_list_lengths"]
    finding = _assert_error(run, "shape_mismatch", [0, 1], {0: "broadcast_objects", 1: "broadcast_objects"})
    assert "3 objects" in finding["message"] and "2 objects" in finding["message"], run.explain()
    assert run.last_words(1).family == "collective_mismatch"
    assert "24 bytes where it had posted room for 16" in finding["message"], run.explain()


def test_an_all_reduce_from_a_backward_hook_is_paired_with_the_ddp_bucket_it_met(zoo):
    run = zoo["hook_all_reduce_in_backward"]
    # Only the abort's words show this pairing: the records number the hook's all_reduce after
    # the backward pass it runs inside.
    finding = _assert_error(run, "collective_mismatch", [1], {0: "backward", 1: "hook_all_reduce"})
    assert run.last_words(1).family == "collective_mismatch"
    assert "DDP gradients of a backward pass" in finding["message"], run.explain()


def test_a_failed_allocation_is_a_memory_verdict(zoo):
    run = zoo["allocation_fails_rank1"]
    finding = _assert_error(run, "out_of_memory", [1], {1: "allocate"})
    assert run.last_words(1).family == "out_of_memory"
    # Rank 0 dies of the lost peer, or is stopped by the agent before it says so (a race): its
    # words, if any, are the consequence's.
    words = run.last_words(0)
    assert words is None or words.family == "peer_lost", words
    assert "consequence" in finding["message"] or words is None, run.explain()


# -- scripts written from public failure reports (tests/run/zoo/redteam) ----------------------


@dataclass(frozen=True)
class Verdict:
    """What `gradsync run` must say of a script: nothing (no category: a healthy run, no finding), or
    its first error, or its one warning, naming `ranks`, each rank in `at` at its tagged line (see
    ZooRun.line)."""

    category: str | None = None
    ranks: tuple[int, ...] = ()
    at: dict[int, str] = field(default_factory=dict)
    severity: str = "error"


REDTEAM_VERDICTS = {
    # Healthy, though one rank works (or sleeps, under the stall timeout) while the others wait.
    "alltoall_consistent_uneven": Verdict(),
    "checkpointed_blocks_ddp": Verdict(),
    "gather_object_ragged_sizes": Verdict(),
    "heavy_getitem_ddp": Verdict(),
    "numpy_whitening_stats": Verdict(),
    "persistent_workers_epochs": Verdict(),
    "rank0_eval_then_barrier": Verdict(),
    "rank1_io_sleep_barrier": Verdict(),
    "shell_out_feature_cache": Verdict(),
    "slow_worker_init_loader": Verdict(),
    "spectral_init_linalg": Verdict(),
    # A rank that never comes: spinning, or idle on something of its own.
    "spin_convergence": Verdict("rank_stuck", (1,), {1: "spin", 0: "peer-wait"}),
    "spin_rebalance_sampler": Verdict("rank_stuck", (0,), {0: "rtlib/balanced:spin", 1: "peer-wait"}),
    "prefetch_queue_dead_thread": Verdict("rank_stuck", (0,), {0: "idle-get", 1: "peer-wait"}),
    "event_never_set_ckpt": Verdict("rank_stuck", (1,), {1: "idle-event", 0: "peer-wait"}),
    "future_lock_deadlock": Verdict("rank_stuck", (1,), {1: "idle-future", 0: "peer-wait", 2: "peer-wait"}),
    # Sizes that disagree, and a collective paired with another.
    "alltoall_expert_routing": Verdict("shape_mismatch", (0, 1), {0: "a2a", 1: "a2a"}),
    "broadcast_resume_state": Verdict("shape_mismatch", (0,), {0: "bcast-obj"}),
    "grad_norm_probe_hook": Verdict("collective_mismatch", (0, 1), {0: "hook-allreduce", 1: "grad-sync"}),
    "ddp_module_hook_probe": Verdict("collective_mismatch", (1,), {1: "hook-allreduce", 0: "backward"}),
    "gather_metrics_short_list": Verdict("rank_crashed", (1,), {1: "gather-obj"}),
    # A group destroyed while the training still needs it.
    "teardown_helper_then_backward": Verdict("script_failed", (0, 1), {0: "backward-after-destroy", 1: "backward-after-destroy"}),
    "eval_rank_closes_world": Verdict("rank_crashed", (1,), {1: "backward-after-destroy"}),
    # A collective after the peer left: in an exit handler, a `finally`, a __del__.
    "atexit_metric_flush": Verdict("collective_after_peer_left", (0,), {0: "atexit-collective"}, "warning"),
    "finally_barrier_after_peer_left": Verdict("collective_after_peer_left", (0,), {0: "finally-barrier"}, "warning"),
    "del_flush_stats": Verdict("collective_after_peer_left", (0,), {0: "del-collective"}, "warning"),
    # A rank that swallowed its error and left.
    "swallowed_shard_error_return": Verdict("rank_exited", (1,), {0: "peer-wait"}),
}


def test_every_redteam_script_has_a_verdict():
    assert sorted(REDTEAM_VERDICTS) == REDTEAM


@pytest.mark.parametrize("name", REDTEAM)
def test_a_script_written_from_a_public_report_gets_its_verdict(zoo, name):
    run, verdict = zoo[f"redteam/{name}"], REDTEAM_VERDICTS[name]
    if verdict.category is None:
        assert run.diagnosis["status"] == "ok" and run.findings() == [], run.explain()
    elif verdict.severity == "warning":
        assert run.diagnosis["status"] == "ok", run.explain()
        (finding,) = [f for f in run.findings() if f["category"] == verdict.category]
        assert finding["severity"] == "warning" and finding["ranks"] == list(verdict.ranks), run.explain()
        assert all(finding["locations"][str(rank)] == run.line(tag) for rank, tag in verdict.at.items()), run.explain()
    else:
        _assert_error(run, verdict.category, list(verdict.ranks), verdict.at)
