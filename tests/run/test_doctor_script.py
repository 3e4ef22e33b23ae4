"""`gradsync run --doctor-steps K`: the script check, on unmodified scripts and on hand-made facts.

Each script of tests/run/doctor_zoo (one mistake each) and a few of tests/run/zoo runs once per
session under the real launcher (torchrun's agent, Gloo, 2 processes), two at a time; the tests
read each run's diagnosis.json, facts files and terminal output. Lines are found by their
`# doctor: <tag>` (doctor_zoo) or `# zoo: <tag>` (zoo) markers. The rules themselves are then
checked on hand-made facts, for the cases a correct script must not be blamed for.
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
import torch

from gradsync.errors import ConfigError
from gradsync.run import launcher
from gradsync.rundir.records import Finding
from gradsync.run.options import RunOptions
from gradsync.run.script_facts import (
    inputs_fingerprint,
    tensor_fingerprint,
    tensor_hash,
)
from gradsync.doctor.script_findings import script_check_findings
from tests.harness import REPO_ROOT

RUN_TESTS = Path(__file__).parent
# name -> (script under tests/run, K)
SCRIPTS = {
    "no_sampler": ("doctor_zoo/no_sampler.py", 4),
    "epoch_not_set": ("doctor_zoo/epoch_not_set.py", 5),  # 2 batches per epoch: the 2nd epoch starts at step 3
    "uneven_shards": ("doctor_zoo/uneven_shards.py", 3),  # stops before the shorter epoch ends
    "accumulation_no_sync": ("doctor_zoo/accumulation_no_sync.py", 3),
    "rank_local_update": ("doctor_zoo/rank_local_update.py", 4),
    "bn_buffers_unsynced": ("doctor_zoo/bn_buffers_unsynced.py", 4),
    "find_unused_all_used": ("doctor_zoo/find_unused_all_used.py", 4),
    "tp_data_by_global_rank": ("doctor_zoo/tp_data_by_global_rank.py", 3),
    "fsdp_root_only": ("doctor_zoo/fsdp_root_only.py", 3),
    # Mistakes that leave the replicas identical (or diverge them with a cause to name):
    "shared_seed_after_ddp": ("doctor_zoo/shared_seed_after_ddp.py", 6),
    "dataset_generator_workers": ("doctor_zoo/dataset_generator_workers.py", 4),
    "sampler_seed_per_rank": ("doctor_zoo/sampler_seed_per_rank.py", 3),
    "shuffle_without_sampler": ("doctor_zoo/shuffle_without_sampler.py", 4),
    "random_split_per_rank": ("doctor_zoo/random_split_per_rank.py", 3),
    "loss_divided_by_world": ("doctor_zoo/loss_divided_by_world.py", 3),
    "eval_left_on_rank0": ("doctor_zoo/eval_left_on_rank0.py", 8),  # rank 0 evaluates after step 4
    "wrapper_eval_left_on_rank0": ("doctor_zoo/wrapper_eval_left_on_rank0.py", 6),  # ddp.eval() after step 3
    "moduledict_from_set": ("doctor_zoo/moduledict_from_set.py", 2),
    "clip_on_rank0": ("doctor_zoo/clip_on_rank0.py", 3),
    "scheduler_on_rank0": ("doctor_zoo/scheduler_on_rank0.py", 5),  # StepLR(step_size=2): lr moves at step 3
    "same_path_saves": ("doctor_zoo/same_path_saves.py", 4),  # saves at step 3
    "healthy_fsdp2_tp": ("zoo/healthy_fsdp2_tp.py", 8),  # 4 FSDP steps, then 4 tensor-parallel ones
    "nan_on_rank1": ("zoo/nan_on_rank1.py", 6),  # NaN at step 4
    "unused_parameter_find": ("zoo/unused_parameter_find.py", 5),
    "healthy_ddp": ("zoo/healthy_ddp.py", 12),  # 8 steps per epoch: stops inside the 2nd epoch
    "healthy_accumulation": ("zoo/healthy_accumulation.py", 20),  # 10 steps: finishes before K
    "healthy_gradsync": ("zoo/healthy_gradsync.py", 20),  # 16 steps: finishes before K
    # The near-misses of the mistakes above, done right:
    "healthy_seeding": ("doctor_zoo/healthy_seeding.py", 20),  # 16 steps: finishes before K
    "healthy_data_split": ("doctor_zoo/healthy_data_split.py", 12),  # into the 2nd epoch's warm-up pass
    "healthy_loss_scale": ("doctor_zoo/healthy_loss_scale.py", 4),
    "healthy_rank0_duties": ("doctor_zoo/healthy_rank0_duties.py", 20),  # 16 steps: finishes before K
}
HEALTHY = ["healthy_ddp", "healthy_accumulation", "healthy_gradsync", "healthy_fsdp2_tp", "healthy_seeding",
           "healthy_data_split", "healthy_loss_scale", "healthy_rank0_duties"]


@dataclass
class DoctorRun:
    name: str
    returncode: int
    output: str
    diagnosis: dict
    run_dir: Path

    @property
    def script(self) -> str:
        return SCRIPTS[self.name][0]

    @property
    def steps(self) -> int:
        return SCRIPTS[self.name][1]

    def line(self, tag: str) -> str:
        """'tests/run/<script>:LINE' of the line marked `# doctor: tag` (or `# zoo: tag`)."""
        marker = "zoo" if self.script.startswith("zoo/") else "doctor"
        text = (RUN_TESTS / self.script).read_text().splitlines()
        numbers = [i for i, line in enumerate(text, 1) if line.rstrip().endswith(f"# {marker}: {tag}")]
        assert len(numbers) == 1, f"{self.script} must mark exactly one line with '# {marker}: {tag}'"
        return f"tests/run/{self.script}:{numbers[0]}"

    def findings(self) -> list[dict]:
        return self.diagnosis["findings"]

    def only(self, category: str, severity: str) -> dict:
        """The run's one finding, which must be `category` with `severity`."""
        assert [(f["category"], f["severity"]) for f in self.findings()] == [(category, severity)], self.explain()
        return self.findings()[0]

    def facts(self, rank: int) -> dict:
        return json.loads((self.run_dir / "workers" / "attempt0" / f"script-check-rank{rank}.json").read_text())

    def exit_record(self, rank: int) -> dict:
        return json.loads((self.run_dir / "workers" / "attempt0" / f"rank{rank}.exit.json").read_text())["exit"]

    def explain(self) -> str:
        return f"{self.name}: exit {self.returncode}\n{json.dumps(self.diagnosis, indent=1)}\n{self.output[-3000:]}"


def _run(name: str, root: Path) -> DoctorRun:
    script, steps = SCRIPTS[name]
    run_dir = root / name
    command = [
        sys.executable, "-m", "gradsync", "run", "--standalone", "--nproc-per-node", "2", "--doctor-steps", str(steps),
        "--stall-timeout", "20", "--run-dir", str(run_dir), f"tests/run/{script}",
    ]
    # A script stopped after K steps never reaches its own clean-up: its temporary files go to `root`.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(root)}
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=150, env=env)
    path = run_dir / "diagnosis.json"
    diagnosis = json.loads(path.read_text()) if path.exists() else {"findings": [], "missing": True}
    return DoctorRun(name, done.returncode, done.stdout + done.stderr, diagnosis, run_dir)


@pytest.fixture(scope="session")
def doctor(tmp_path_factory) -> dict[str, DoctorRun]:
    root = tmp_path_factory.mktemp("doctor")
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = list(pool.map(lambda name: _run(name, root), SCRIPTS))
    print(f"\n{len(runs)} --doctor-steps runs in {time.monotonic() - start:.0f} s", file=sys.stderr)
    return {run.name: run for run in runs}


# -- one script per mistake ---------------------------------------------------------------------


def _assert_failed(run: DoctorRun, category: str) -> None:
    assert run.returncode == 1 and run.diagnosis["status"] == "failed", run.explain()
    assert f"gradsync run: FAILED: {category} (ranks 0, 1)" in run.output, run.explain()


def _assert_warned(run: DoctorRun, category: str) -> None:
    assert run.returncode == 0 and run.diagnosis["status"] == "ok", run.explain()
    assert f"warning: {category} (ranks [0, 1])" in run.output, run.explain()


def test_identical_batches_on_every_rank(doctor):
    run = doctor["no_sampler"]
    finding = run.only("no_distributed_sampler", "error")
    assert finding["ranks"] == [0, 1]
    assert finding["locations"] == {"0": run.line("forward"), "1": run.line("forward")}, run.explain()
    assert run.line("loop") in finding["message"]  # where the batches come from
    assert finding["details"]["forwards_compared"] == run.steps
    _assert_failed(run, "no_distributed_sampler")


def test_sampler_iterated_again_without_set_epoch(doctor):
    run = doctor["epoch_not_set"]
    finding = run.only("sampler_epoch_not_set", "warning")
    assert finding["ranks"] == [0, 1]
    assert finding["locations"] == {"0": run.line("loop"), "1": run.line("loop")}, run.explain()
    assert finding["details"] == {"epoch": 0}
    _assert_warned(run, "sampler_epoch_not_set")


def test_uneven_batches_per_rank(doctor):
    run = doctor["uneven_shards"]
    finding = run.only("uneven_batches", "error")
    assert finding["ranks"] == [0, 1]
    assert finding["locations"] == {"0": run.line("loop"), "1": run.line("loop")}, run.explain()
    assert finding["details"] == {"batches": {"0": 5, "1": 4}}
    assert "rank 0: 5 batches (80 samples), rank 1: 4 batches (64 samples)" in finding["message"]
    assert "hang at the end of the epoch" in finding["message"]
    _assert_failed(run, "uneven_batches")


def test_accumulation_without_no_sync(doctor):
    run = doctor["accumulation_no_sync"]
    finding = run.only("accumulation_without_no_sync", "warning")
    assert finding["ranks"] == [0, 1]
    assert finding["locations"] == {"0": run.line("backward"), "1": run.line("backward")}, run.explain()
    assert finding["details"] == {"syncs_per_step": {"0": 4.0, "1": 4.0}}
    assert "4× the needed gradient traffic" in finding["message"]
    assert "no_sync()" in finding["suggestion"]
    _assert_warned(run, "accumulation_without_no_sync")


def test_rank_local_parameter_update(doctor):
    run = doctor["rank_local_update"]
    # Named at the first step it shows, on the rank that did it, after the step it followed.
    finding = run.only("update_differs", "error")
    assert finding["ranks"] == [1] and finding["step"] == 2, run.explain()
    assert finding["details"] == {"differs": "parameters", "optimizer": 0}
    assert finding["locations"] == {"1": run.line("step")}
    assert "rank 1 changed them after optimizer step 1" in finding["message"]
    assert run.returncode == 1 and "gradsync run: FAILED: update_differs (rank 1)" in run.output, run.explain()


def test_batchnorm_buffers_without_buffer_sync(doctor):
    run = doctor["bn_buffers_unsynced"]
    finding = run.only("buffers_diverged", "error")  # the parameters themselves stay equal
    assert finding["ranks"] == [0, 1] and finding["step"] == run.steps
    assert finding["details"] == {"buffers": ["1.running_mean", "1.running_var"]}, run.explain()
    assert finding["locations"] == {"0": run.line("ddp"), "1": run.line("ddp")}
    _assert_failed(run, "buffers_diverged")


def test_find_unused_parameters_without_unused_parameters(doctor):
    run = doctor["find_unused_all_used"]
    finding = run.only("find_unused_parameters_unneeded", "warning")
    assert finding["ranks"] == [0, 1]
    assert finding["locations"] == {"0": run.line("ddp"), "1": run.line("ddp")}, run.explain()
    assert f"each of the {run.steps} synchronised backward passes" in finding["message"]
    _assert_warned(run, "find_unused_parameters_unneeded")


def test_nonfinite_gradients_are_reported_in_doctor_mode(doctor):
    run = doctor["nan_on_rank1"]
    finding = run.only("nonfinite_gradients", "warning")  # the NaN spread to both replicas alike
    assert finding["ranks"] == [1] and finding["step"] == 4, run.explain()
    assert finding["locations"] == {"1": run.line("backward")}


def test_unused_parameters_are_reported_in_doctor_mode(doctor):
    run = doctor["unused_parameter_find"]
    finding = run.only("unused_parameters", "warning")  # so find_unused_parameters is needed: no other warning
    assert finding["details"]["parameters"] == ["unused_head.weight", "unused_head.bias"], run.explain()


def test_tensor_parallel_ranks_fed_different_batches(doctor):
    run = doctor["tp_data_by_global_rank"]
    finding = run.only("tensor_parallel_inputs_differ", "error")
    assert finding["ranks"] == [0, 1]
    assert finding["locations"] == {"0": run.line("parallelize"), "1": run.line("parallelize")}, run.explain()
    assert f"in {run.steps} of {run.steps} training forwards" in finding["message"], run.explain()
    assert "data-parallel rank" in finding["suggestion"]
    _assert_failed(run, "tensor_parallel_inputs_differ")


def test_fsdp_on_the_root_alone_is_a_warning(doctor):
    run = doctor["fsdp_root_only"]
    finding = run.only("fsdp_root_holds_most", "warning")
    assert finding["locations"] == {"0": run.line("shard"), "1": run.line("shard")}, run.explain()
    assert "The Sequential sharded with fully_shard" in finding["message"], run.explain()
    assert "keeps 100% of its 5,313 parameters in its root unit (the largest part: '2', 78%)" in finding["message"], run.explain()
    _assert_warned(run, "fsdp_root_holds_most")


# -- mistakes that leave the replicas identical ------------------------------------------------


def test_generators_seeded_alike_after_ddp_are_named_at_the_seeding_line(doctor):
    run = doctor["shared_seed_after_ddp"]
    finding = run.only("shared_random_draws", "warning")
    assert finding["locations"] == {"0": run.line("seed"), "1": run.line("seed")}, run.explain()
    assert finding["details"]["generator"] == "torch" and finding["details"]["draws_compared"] >= run.steps
    _assert_warned(run, "shared_random_draws")


def test_a_generator_on_the_dataset_copied_into_workers(doctor):
    run = doctor["dataset_generator_workers"]
    finding = run.only("dataset_generator_copied", "warning")
    assert finding["locations"] == {"0": run.line("rng"), "1": run.line("rng")}, run.explain()  # where it was made
    assert f"iterated at {run.line('loop')}" in finding["message"]
    assert finding["details"] == {"generators": ["rng"], "workers": 2}
    assert "across its 2 workers" in finding["message"] and "on ranks 0, 1" in finding["message"]
    _assert_warned(run, "dataset_generator_copied")


def test_samplers_seeded_per_rank_overlap_and_leave_samples_out(doctor):
    run = doctor["sampler_seed_per_rank"]
    finding = run.only("sampler_overlap", "error")
    assert finding["locations"] == {"0": run.line("sampler"), "1": run.line("sampler")}, run.explain()
    details = finding["details"]  # a partial pass (stopped at step K): the overlap so far, coverage unknown
    assert details["samples"] == 320 and details["drawn_twice"] > 0 and not details["complete"], details
    assert "seeds differ (rank 0: seed=17, rank 1: seed=18)" in finding["message"]
    _assert_failed(run, "sampler_overlap")


def test_shuffling_without_a_sampler_overlaps_though_no_batch_is_identical(doctor):
    run = doctor["shuffle_without_sampler"]
    finding = run.only("sampler_overlap", "error")  # no_distributed_sampler needs identical batches
    assert finding["locations"] == {"0": run.line("loop"), "1": run.line("loop")}, run.explain()
    assert "no rank uses a DistributedSampler" in finding["message"] and finding["details"]["drawn_twice"] > 0
    _assert_failed(run, "sampler_overlap")


def test_a_random_split_that_differs_per_rank(doctor):
    run = doctor["random_split_per_rank"]
    finding = run.only("data_split_differs", "error")
    assert finding["locations"] == {"0": run.line("split"), "1": run.line("split")}, run.explain()
    assert "without a generator" in finding["message"] and "in rank 1's second one" in finding["message"]
    _assert_failed(run, "data_split_differs")


def test_a_loss_divided_by_the_world_size_under_ddp(doctor):
    run = doctor["loss_divided_by_world"]
    finding = run.only("loss_scaled_by_world_size", "warning")
    # Named at the division itself (anomaly mode keeps the first step's forward tracebacks).
    assert finding["locations"] == {"0": run.line("loss"), "1": run.line("loss")}, run.explain()
    assert f"backward at {run.line('backward')}" in finding["message"]
    assert finding["details"] == {"scale": 0.5, "world_size": 2}
    _assert_warned(run, "loss_scaled_by_world_size")


def test_rank_0_left_in_eval_mode_is_named_with_its_eval_line(doctor):
    run = doctor["eval_left_on_rank0"]
    finding = run.only("eval_mode_differs", "error")
    assert finding["ranks"] == [0] and finding["locations"] == {"0": run.line("eval")}, run.explain()
    assert finding["details"]["forward"] == 5  # the first training forward after the evaluation at step 4
    assert run.returncode == 1 and "gradsync run: FAILED: eval_mode_differs (rank 0)" in run.output, run.explain()


def test_rank_0_that_switched_the_ddp_wrapper_to_eval_is_found_at_its_steps(doctor):
    run = doctor["wrapper_eval_left_on_rank0"]
    finding = run.only("eval_mode_differs", "error")
    assert finding["ranks"] == [0] and finding["locations"] == {"0": run.line("eval")}, run.explain()
    assert finding["details"]["step"] == 4 and finding["details"]["eval_modules"][0] == "(the DDP wrapper)"


def test_parameters_in_a_rank_dependent_order_are_found_at_construction(doctor):
    run = doctor["moduledict_from_set"]
    finding = run.only("parameter_order_differs", "error")  # the divergence it causes is not reported twice
    assert finding["locations"] == {"0": run.line("ddp"), "1": run.line("ddp")}, run.explain()
    names = finding["details"]["names"]
    assert names["0"] != names["1"] and "(the same names, ordered differently)" in finding["message"]
    _assert_failed(run, "parameter_order_differs")


@pytest.mark.parametrize(("name", "tag", "step", "differs"), [
    ("clip_on_rank0", "clip", 1, "gradients"),
    ("scheduler_on_rank0", "scheduler", 3, "hyperparameters"),
])
def test_an_update_changed_on_rank_0_only_is_blamed_on_its_call(doctor, name, tag, step, differs):
    run = doctor[name]
    finding = run.only("update_differs", "error")
    assert finding["ranks"] == [0] and finding["locations"] == {"0": run.line(tag)}, run.explain()
    assert finding["step"] == step and finding["details"]["differs"] == differs, run.explain()
    assert run.returncode == 1 and "gradsync run: FAILED: update_differs (rank 0)" in run.output, run.explain()


def test_every_rank_saving_to_the_same_path(doctor):
    run = doctor["same_path_saves"]
    finding = run.only("same_file_written", "error")
    assert finding["locations"] == {"0": run.line("save"), "1": run.line("save")}, run.explain()
    assert finding["details"]["path"].endswith("/model.pt") and "at the same step" in finding["message"]
    _assert_failed(run, "same_file_written")


# -- healthy scripts and how ranks end ----------------------------------------------------------


@pytest.mark.parametrize("name", HEALTHY)
def test_healthy_scripts_get_no_findings(doctor, name):
    run = doctor[name]
    assert run.returncode == 0 and run.diagnosis["status"] == "ok", run.explain()
    assert run.findings() == [], run.explain()
    assert "gradsync run: ok: 2 ranks finished" in run.output and "warning:" not in run.output, run.explain()


def test_every_rank_stops_right_after_its_kth_optimizer_step(doctor):
    for name in ("healthy_ddp", "no_sampler", "uneven_shards"):
        run = doctor[name]
        for rank in (0, 1):
            assert run.exit_record(rank)["stopped_after_steps"] == run.steps, run.explain()
            assert run.facts(rank)["steps"] == run.steps
            assert run.diagnosis["ranks"][str(rank)].startswith(f"stopped after optimizer step {run.steps} (--doctor-steps)")


def test_a_script_shorter_than_k_steps_is_checked_on_what_it_did(doctor):
    run = doctor["healthy_accumulation"]
    for rank in (0, 1):
        facts = run.facts(rank)
        assert facts["steps"] == 10 and facts["syncs_per_step"] == [1] * 10, facts
        assert len(facts["forwards"]) == 40 and len(facts["models"]) == 1
        assert "stopped_after_steps" not in run.exit_record(rank)
        assert run.diagnosis["ranks"][str(rank)].startswith("finished its script")


def test_bad_values_of_doctor_steps_are_refused_with_exit_code_2(tmp_path, capsys):
    assert launcher.main(["--doctor-steps", "0", "--run-dir", str(tmp_path), "train.py"]) == 2
    assert "--doctor-steps 0: give the number of optimizer steps to check" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exiting:
        launcher.main(["--doctor-steps", "twenty", "--run-dir", str(tmp_path), "train.py"])
    assert exiting.value.code == 2
    assert "--doctor-steps: invalid int value: 'twenty'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="at least 1"):
        RunOptions(run_dir=tmp_path, doctor_steps=-3)


def test_doctor_steps_reach_the_workers_through_the_options_file(tmp_path):
    assert RunOptions.load(RunOptions(run_dir=tmp_path, doctor_steps=7).save()).doctor_steps == 7
    assert RunOptions.load(RunOptions(run_dir=tmp_path).save()).doctor_steps is None


# -- fingerprints -------------------------------------------------------------------------------


def test_fingerprints_tell_batches_apart_and_hashes_see_every_value():
    batch = torch.arange(10_000, dtype=torch.float32).reshape(100, 100)
    assert tensor_fingerprint(batch) == tensor_fingerprint(batch.clone())
    assert tensor_fingerprint(batch) != tensor_fingerprint(batch + 1)
    assert tensor_fingerprint(batch) != tensor_fingerprint(batch.double())
    assert tensor_fingerprint(batch) != tensor_fingerprint(batch.reshape(10_000))
    nudged = batch.clone()
    nudged[0, 1] += 1  # not among the sampled values, but a hash reads them all
    assert tensor_fingerprint(nudged) == tensor_fingerprint(batch)
    assert tensor_hash(nudged) != tensor_hash(batch)
    assert tensor_hash(torch.tensor(3)) != tensor_hash(torch.tensor(4))  # 0-dim (num_batches_tracked)


def test_input_fingerprints_cover_nested_arguments():
    x, mask = torch.randn(4, 3), torch.ones(4)
    assert inputs_fingerprint((x,), {"mask": mask}) == inputs_fingerprint((x.clone(),), {"mask": mask.clone()})
    assert inputs_fingerprint(({"x": x},), {}) != inputs_fingerprint(({"x": x + 1},), {})
    assert inputs_fingerprint((3, "text"), {}) is None  # nothing to compare


# -- the rules on hand-made facts ---------------------------------------------------------------


def _facts(**overrides) -> dict:
    facts = {
        "doctor_steps": 4,
        "steps": 4,
        "syncs_per_step": [1, 1, 1, 1],
        "backward_site": "train.py:30",
        "forwards": [],
        "loaders": [],
        "sampler_passes": [],
        "models": [],
    }
    return {**facts, **overrides}


def _forward(fingerprint: int | None) -> dict:
    return {"fingerprint": fingerprint, "site": "train.py:28", "loader": None}


def _loader(batches: int, **overrides) -> dict:
    loader = {"key": "train.py:27#0", "site": "train.py:27", "batches": batches, "samples": None, "sampler": 0,
              "feeds_training": True, "under_join": False}
    return {**loader, **overrides}


def _model(parameters: dict, buffers: dict | None = None, **overrides) -> dict:
    model = {"site": "train.py:20", "find_unused_parameters": False, "usage_checked_passes": 0, "incomplete_passes": 0,
             "buffers_synced": True, "parameters": parameters, "buffers": buffers or {}}
    return {**model, **overrides}


def _categories(checks: dict[int, dict]) -> list[str]:
    return [finding.category for finding in script_check_findings(checks)]


def test_identical_inputs_count_only_when_every_compared_forward_agrees():
    same = [_forward(1), _forward(2)]
    assert _categories({0: _facts(forwards=same), 1: _facts(forwards=same)}) == ["no_distributed_sampler"]
    assert _categories({0: _facts(forwards=same), 1: _facts(forwards=[_forward(1), _forward(3)])}) == []
    # Forwards without comparable tensors are left out; with none left there is nothing to say.
    assert _categories({0: _facts(forwards=[_forward(None)]), 1: _facts(forwards=[_forward(None)])}) == []
    assert _categories({0: _facts(forwards=same)}) == []  # one rank: nothing to compare with


def test_uneven_loaders_count_only_when_they_feed_training_outside_join():
    assert _categories({0: _facts(loaders=[_loader(5)]), 1: _facts(loaders=[_loader(4)])}) == ["uneven_batches"]
    assert _categories({0: _facts(loaders=[_loader(5)]), 1: _facts(loaders=[_loader(5)])}) == []
    evaluation = {0: _facts(loaders=[_loader(5, feeds_training=False)]), 1: _facts(loaders=[_loader(4, feeds_training=False)])}
    assert _categories(evaluation) == []  # uneven evaluation runs no collective per batch
    joined = {0: _facts(loaders=[_loader(5, under_join=True)]), 1: _facts(loaders=[_loader(4, under_join=True)])}
    assert _categories(joined) == []
    three = {0: _facts(loaders=[_loader(5)]), 1: _facts(loaders=[_loader(5)]), 2: _facts(loaders=[_loader(4)])}
    assert [f.ranks for f in script_check_findings(three)] == [[2]]


def test_a_repeated_epoch_counts_only_for_a_shuffling_sampler_that_feeds_training():
    passes = [{"sampler": 0, "epoch": 0, "shuffle": True, "site": "train.py:27"}] * 2
    assert _categories({0: _facts(sampler_passes=passes, loaders=[_loader(4)])}) == ["sampler_epoch_not_set"]
    assert _categories({0: _facts(sampler_passes=passes)}) == ["sampler_epoch_not_set"]  # no DataLoader seen
    assert _categories({0: _facts(sampler_passes=passes, loaders=[_loader(4, feeds_training=False)])}) == []
    unshuffled = [{**p, "shuffle": False} for p in passes]
    assert _categories({0: _facts(sampler_passes=unshuffled, loaders=[_loader(4)])}) == []
    set_epoch = [passes[0], {**passes[0], "epoch": 1}, {**passes[0], "epoch": 2}]
    assert _categories({0: _facts(sampler_passes=set_epoch, loaders=[_loader(4)])}) == []


def test_a_sampler_iterated_twice_in_one_epoch_at_two_lines_is_not_a_missing_set_epoch():
    # set_epoch(e), list(sampler) to warm a cache (one line), then the DataLoader's pass (another).
    def passes(epoch, calls):
        return [{"sampler": 0, "epoch": epoch, "shuffle": True, "site": site, "set_epoch_calls": calls}
                for site in ("train.py:40", "train.py:41")]

    warmed = passes(0, 1) + passes(1, 2)
    assert _categories({0: _facts(sampler_passes=warmed, loaders=[_loader(4)])}) == []
    # The same line passing again with the same epoch and no set_epoch in between: the order repeats.
    repeated = passes(0, 1) + passes(0, 1)
    assert _categories({0: _facts(sampler_passes=repeated, loaders=[_loader(4)])}) == ["sampler_epoch_not_set"]


def test_accumulation_is_judged_on_the_typical_step():
    assert _categories({0: _facts(syncs_per_step=[4, 4, 4])}) == ["accumulation_without_no_sync"]
    # A GradScaler that skipped a step leaves one step with two synchronised passes: not accumulation.
    assert _categories({0: _facts(syncs_per_step=[1, 2, 1, 1])}) == []
    # Two optimizers stepping after one backward: half a pass per step.
    assert _categories({0: _facts(syncs_per_step=[1, 0, 1, 0])}) == []


def test_replicas_are_compared_only_at_the_same_step_and_name_the_odd_rank():
    equal, other = {"w": 1, "b": 2}, {"w": 1, "b": 3}
    three = {0: _facts(models=[_model(equal)]), 1: _facts(models=[_model(equal)]), 2: _facts(models=[_model(other)])}
    (finding,) = script_check_findings(three)
    assert (finding.category, finding.ranks, finding.details) == ("parameters_diverged", [2], {"parameters": ["b"]})
    assert "on rank 2 from the other ranks'" in finding.message
    different_steps = {0: _facts(models=[_model(equal)]), 1: _facts(steps=3, models=[_model(other)])}
    assert _categories(different_steps) == []


def test_buffers_count_only_when_ddp_does_not_sync_them():
    synced = {0: _facts(models=[_model({}, {"bn.running_mean": 1})]), 1: _facts(models=[_model({}, {"bn.running_mean": 2})])}
    assert _categories(synced) == []  # the next forward starts from rank 0's buffers
    unsynced = {r: _facts(models=[_model({}, {"bn.running_mean": r}, buffers_synced=False)]) for r in (0, 1)}
    assert _categories(unsynced) == ["buffers_diverged"]


def test_find_unused_parameters_is_needed_when_a_pass_missed_a_gradient():
    def checks(incomplete: int) -> dict:
        model = _model({}, find_unused_parameters=True, usage_checked_passes=4, incomplete_passes=incomplete)
        return {0: _facts(models=[model]), 1: _facts(models=[model])}

    assert _categories(checks(0)) == ["find_unused_parameters_unneeded"]
    assert _categories(checks(1)) == []


def test_findings_must_use_the_vocabulary():
    with pytest.raises(ValueError, match="not in CATEGORIES"):
        Finding("no_such_category", "error", [0], "message", "suggestion")
    with pytest.raises(ValueError, match="not in CATEGORIES"):
        Finding("uneven_batches", "warning", [0], "message", "suggestion")


def _tp_module(inputs, ranks=(0, 1), styles=("ColwiseParallel", "RowwiseParallel")) -> dict:
    return {"site": "train.py:12", "ranks": list(ranks), "styles": list(styles), "inputs": list(inputs)}


def test_tensor_parallel_inputs_are_compared_within_each_group_only():
    # Ranks 0-1 and 2-3 are two tensor-parallel groups (fsdp+tp): each group shares its batches,
    # the groups differ (they are data-parallel peers). Only a group whose ranks differ is wrong.
    same = {0: _facts(tp_modules=[_tp_module([1, 2], (0, 1))]), 1: _facts(tp_modules=[_tp_module([1, 2], (0, 1))]),
            2: _facts(tp_modules=[_tp_module([7, 8], (2, 3))]), 3: _facts(tp_modules=[_tp_module([7, 8], (2, 3))])}
    assert script_check_findings(same) == []
    same[3] = _facts(tp_modules=[_tp_module([7, 9], (2, 3))])
    (finding,) = script_check_findings(same)
    assert finding.category == "tensor_parallel_inputs_differ" and finding.ranks == [2, 3]
    assert "in 1 of 2 training forwards (first: forward 2)" in finding.message
    # Sequence parallelism shards a module's inputs on purpose: not compared.
    sharded = {r: _facts(tp_modules=[_tp_module([r], styles=("SequenceParallel",))]) for r in (0, 1)}
    assert script_check_findings(sharded) == []


def test_an_fsdp_root_unit_holding_most_parameters_is_a_warning_and_well_split_models_are_not():
    def root(kept, largest):
        return {"site": "train.py:20", "class": "Transformer", "parameters": 1000, "in_root_unit": kept,
                "largest_in_root": largest}

    (finding,) = script_check_findings({r: _facts(fsdp_roots=[root(800, ["tok_embeddings", 700])]) for r in (0, 1)})
    assert finding.category == "fsdp_root_holds_most" and finding.severity == "warning"
    assert "keeps 80% of its 1,000 parameters in its root unit (the largest part: 'tok_embeddings', 70%)" in finding.message
    assert script_check_findings({r: _facts(fsdp_roots=[root(300, ["norm", 10])]) for r in (0, 1)}) == []


def test_no_facts_at_all_give_no_finding():
    # A job not run under --doctor-steps (or whose ranks all died before writing) has none to compare.
    assert script_check_findings({}) == []
