"""`gradsync run --doctor-steps K`: the script check, on unmodified scripts and on hand-made facts.

Each script of tests/run/doctor_zoo (one mistake each) and a few of tests/run/zoo run under the
real launcher (torchrun's agent, Gloo, 2 processes), two at a time, or are made again from their
recordings (tests/run/doctor_harness.py); the tests read each run's diagnosis.json, facts files
and terminal output. The rules themselves are then checked on hand-made facts, for the cases a correct script
must not be blamed for. The consistency checks' scripts are in test_doctor_consistency.py.
"""

from __future__ import annotations


import pytest
import torch

from gradsync.errors import ConfigError
from gradsync.run import launcher
from gradsync.rundir.records import Finding
from gradsync.run.options import RunOptions
from gradsync.run.check_primitives import (
    inputs_fingerprint,
    tensor_fingerprint,
    tensor_hash,
)
from gradsync.doctor.script_findings import script_check_findings
from tests.conftest import ZOO_OPTION
from tests.run.doctor_harness import assert_failed, assert_warned, guard_of, run_all
from tests.run.recordings import Runs, assert_every_field_recorded
from tests.timed_findings import untimed_warning_lines

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
    "healthy_fsdp2_tp": ("zoo/healthy_fsdp2_tp.py", 8),  # 4 FSDP steps, then 4 tensor-parallel ones
    "nan_on_rank1": ("zoo/nan_on_rank1.py", 6),  # NaN at step 4
    "unused_parameter_find": ("zoo/unused_parameter_find.py", 5),
    "healthy_ddp": ("zoo/healthy_ddp.py", 12),  # 8 steps per epoch: stops inside the 2nd epoch
    "healthy_accumulation": ("zoo/healthy_accumulation.py", 20),  # 10 steps: finishes before K
    "healthy_gradsync": ("zoo/healthy_gradsync.py", 20),  # 16 steps: finishes before K
}

# The session's fixture makes every run above; pytest's default 300 s is less than they may take.
pytestmark = guard_of(SCRIPTS)

HEALTHY = ["healthy_ddp", "healthy_accumulation", "healthy_gradsync", "healthy_fsdp2_tp"]


# Launched under `make test`: a failure (exit code 1, the terminal block) and a healthy run (exit
# code 0); the others are made again from their recordings (tests/run/recordings.py).
LIVE = ["rank_local_update", "healthy_ddp"]


@pytest.fixture(scope="session")
def doctor(request, tmp_path_factory) -> Runs:
    return run_all(SCRIPTS, LIVE, "doctor_script", request.config.getoption(ZOO_OPTION), tmp_path_factory.mktemp("doctor"))


@pytest.mark.launches
def test_the_recordings_have_every_field_the_ranks_record_now(doctor):
    assert_every_field_recorded(doctor, "doctor_script")


# -- one script per mistake ---------------------------------------------------------------------


@pytest.mark.launches
def test_identical_batches_on_every_rank(doctor):
    run = doctor["no_sampler"]
    finding = run.only("no_distributed_sampler", "error")
    assert finding["ranks"] == [0, 1]
    assert finding["locations"] == {"0": run.line("forward"), "1": run.line("forward")}, run.explain()
    assert run.line("loop") in finding["message"]  # where the batches come from
    assert finding["details"]["forwards_compared"] == run.steps
    assert_failed(run, "no_distributed_sampler")


@pytest.mark.launches
def test_sampler_iterated_again_without_set_epoch(doctor):
    run = doctor["epoch_not_set"]
    finding = run.only("sampler_epoch_not_set", "warning")
    assert finding["ranks"] == [0, 1]
    assert finding["locations"] == {"0": run.line("loop"), "1": run.line("loop")}, run.explain()
    assert finding["details"] == {"epoch": 0}
    assert_warned(run, "sampler_epoch_not_set")


@pytest.mark.launches
def test_uneven_batches_per_rank(doctor):
    run = doctor["uneven_shards"]
    finding = run.only("uneven_batches", "error")
    assert finding["ranks"] == [0, 1]
    assert finding["locations"] == {"0": run.line("loop"), "1": run.line("loop")}, run.explain()
    assert finding["details"] == {"batches": {"0": 5, "1": 4}}
    assert "rank 0: 5 batches (80 samples), rank 1: 4 batches (64 samples)" in finding["message"]
    assert "hang at the end of the epoch" in finding["message"]
    assert_failed(run, "uneven_batches")


@pytest.mark.launches
def test_accumulation_without_no_sync(doctor):
    run = doctor["accumulation_no_sync"]
    finding = run.only("accumulation_without_no_sync", "warning")
    assert finding["ranks"] == [0, 1]
    assert finding["locations"] == {"0": run.line("backward"), "1": run.line("backward")}, run.explain()
    assert finding["details"] == {"syncs_per_step": {"0": 4.0, "1": 4.0}}
    assert "4× the needed gradient traffic" in finding["message"]
    assert "no_sync()" in finding["suggestion"]
    assert_warned(run, "accumulation_without_no_sync")


@pytest.mark.launches
def test_rank_local_parameter_update(doctor):
    run = doctor["rank_local_update"]
    # Named at the first step it shows, on the rank that did it, after the step it followed.
    finding = run.only("update_differs", "error")
    assert finding["ranks"] == [1] and finding["step"] == 2, run.explain()
    assert finding["details"] == {"differs": "parameters", "optimizer": 0}
    assert finding["locations"] == {"1": run.line("step")}
    assert "rank 1 changed them after optimizer step 1" in finding["message"]
    assert not run.live or run.returncode == 1, run.explain()
    assert "gradsync run: FAILED: update_differs (rank 1)" in run.output, run.explain()


@pytest.mark.launches
def test_batchnorm_buffers_without_buffer_sync(doctor):
    run = doctor["bn_buffers_unsynced"]
    finding = run.only("buffers_diverged", "error")  # the parameters themselves stay equal
    assert finding["ranks"] == [0, 1] and finding["step"] == run.steps
    assert finding["details"] == {"buffers": ["1.running_mean", "1.running_var"]}, run.explain()
    assert finding["locations"] == {"0": run.line("ddp"), "1": run.line("ddp")}
    assert_failed(run, "buffers_diverged")


@pytest.mark.launches
def test_find_unused_parameters_without_unused_parameters(doctor):
    run = doctor["find_unused_all_used"]
    finding = run.only("find_unused_parameters_unneeded", "warning")
    assert finding["ranks"] == [0, 1]
    assert finding["locations"] == {"0": run.line("ddp"), "1": run.line("ddp")}, run.explain()
    assert f"each of the {run.steps} synchronised backward passes" in finding["message"]
    assert_warned(run, "find_unused_parameters_unneeded")


@pytest.mark.launches
def test_nonfinite_gradients_are_reported_in_doctor_mode(doctor):
    run = doctor["nan_on_rank1"]
    finding = run.only("nonfinite_gradients", "warning")  # the NaN spread to both replicas alike
    assert finding["ranks"] == [1] and finding["step"] == 4, run.explain()
    assert finding["locations"] == {"1": run.line("backward")}


@pytest.mark.launches
def test_unused_parameters_are_reported_in_doctor_mode(doctor):
    run = doctor["unused_parameter_find"]
    finding = run.only("unused_parameters", "warning")  # so find_unused_parameters is needed: no other warning
    assert finding["details"]["parameters"] == ["unused_head.weight", "unused_head.bias"], run.explain()


@pytest.mark.launches
def test_tensor_parallel_ranks_fed_different_batches(doctor):
    run = doctor["tp_data_by_global_rank"]
    finding = run.only("tensor_parallel_inputs_differ", "error")
    assert finding["ranks"] == [0, 1]
    assert finding["locations"] == {"0": run.line("parallelize"), "1": run.line("parallelize")}, run.explain()
    assert f"in {run.steps} of {run.steps} training forwards" in finding["message"], run.explain()
    assert "data-parallel rank" in finding["suggestion"]
    assert_failed(run, "tensor_parallel_inputs_differ")


@pytest.mark.launches
def test_fsdp_on_the_root_alone_is_a_warning(doctor):
    run = doctor["fsdp_root_only"]
    finding = run.only("fsdp_root_holds_most", "warning")
    assert finding["locations"] == {"0": run.line("shard"), "1": run.line("shard")}, run.explain()
    assert "The Sequential sharded with fully_shard" in finding["message"], run.explain()
    assert "keeps 100% of its 5,313 parameters in its root unit (the largest part: '2', 78%)" in finding["message"], run.explain()
    assert_warned(run, "fsdp_root_holds_most")


# -- healthy scripts and how ranks end ----------------------------------------------------------


@pytest.mark.launches
@pytest.mark.parametrize("name", HEALTHY)
def test_healthy_scripts_get_no_findings(doctor, name):
    run = doctor[name]
    assert not run.live or run.returncode == 0, run.explain()
    assert run.diagnosis["status"] == "ok" and run.findings() == [], run.explain()
    assert "gradsync run: ok: 2 ranks finished" in run.output and untimed_warning_lines(run.output) == [], run.explain()


@pytest.mark.launches
def test_every_rank_stops_right_after_its_kth_optimizer_step(doctor):
    for name in ("healthy_ddp", "no_sampler", "uneven_shards"):
        run = doctor[name]
        for rank in (0, 1):
            assert run.exit_record(rank)["stopped_after_steps"] == run.steps, run.explain()
            assert run.facts(rank)["steps"] == run.steps
            assert run.diagnosis["ranks"][str(rank)].startswith(f"stopped after optimizer step {run.steps} (--doctor-steps)")


@pytest.mark.launches
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
