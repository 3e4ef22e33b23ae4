"""`gradsync run --doctor-steps K`: the script check, on unmodified scripts and on hand-made facts.

Each script of tests/run/doctor_zoo (one mistake each) and a few of tests/run/zoo run under the
real launcher (torchrun's agent, Gloo, 2 processes), two at a time, or are made again from their
recordings (tests/run/doctor_harness.py); the tests read each run's diagnosis.json, facts files
and terminal output. The checks' rules themselves are checked on hand-made facts, for the cases a
correct script must not be blamed for, in tests/run/scriptcheck/. The consistency checks' scripts
are in test_doctor_consistency.py.
"""

from __future__ import annotations


import pytest
import torch

from gradsync.doctor import script as script_check
from gradsync.errors import ConfigError
from gradsync.run import launcher
from gradsync.run.options import RunOptions
from gradsync.run.check_primitives import (
    inputs_fingerprint,
    tensor_fingerprint,
    tensor_hash,
)
from tests.conftest import ZOO_OPTION
from tests.run.doctor_harness import assert_as_under_plain_torchrun, assert_failed, assert_warned, guard_of, plain_views, run_all
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


@pytest.fixture(scope="session")
def plain(request, tmp_path_factory) -> Runs:
    return plain_views(SCRIPTS, request.config.getoption(ZOO_OPTION), tmp_path_factory.mktemp("plain"))


@pytest.mark.launches
@pytest.mark.parametrize("name", SCRIPTS)
def test_each_rank_ends_and_prints_as_under_plain_torchrun_for_the_same_steps(doctor, plain, name):
    assert_as_under_plain_torchrun(doctor[name], plain[name])


@pytest.mark.launches
def test_the_recordings_have_every_field_the_ranks_record_now(doctor):
    assert_every_field_recorded(doctor, "doctor_script")


# -- one script per mistake ---------------------------------------------------------------------


@pytest.mark.launches
def test_identical_batches_on_every_rank(doctor):
    run = doctor["no_sampler"]
    finding = run.only("no_distributed_sampler", "error")
    assert finding["ranks"] == [0, 1]
    # Named where the samples were chosen: the DataLoader built without a DistributedSampler.
    assert finding["locations"] == {"0": run.line("loader"), "1": run.line("loader")}, run.explain()
    assert run.line("loop") in finding["message"] and run.line("forward") in finding["message"]
    assert finding["details"]["forwards_compared"] == run.steps
    assert_failed(run, "no_distributed_sampler")


@pytest.mark.launches
def test_sampler_iterated_again_without_set_epoch(doctor):
    run = doctor["epoch_not_set"]
    finding = run.only("sampler_epoch_not_set", "warning")
    assert finding["ranks"] == [0, 1]
    # Named at the epoch loop, where set_epoch belongs; the pass that repeated is said too.
    assert finding["locations"] == {"0": run.line("epochs"), "1": run.line("epochs")}, run.explain()
    assert run.line("loop") in finding["message"]
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
    # Named at the first step it shows, on the rank that did it, at the write itself (read at the tensor level).
    finding = run.only("state_written_on_some_ranks", "error")
    assert finding["ranks"] == [1] and finding["step"] == 2, run.explain()
    assert (finding["details"]["differs"], finding["details"]["write"]) == (["parameters"], "add_")
    assert finding["locations"] == {"1": run.line("noise")}
    assert "rank 1 ran `add_` on the parameter 0.weight" in finding["message"] and "after step 1" in finding["message"]
    assert not run.live or run.returncode == 1, run.explain()
    assert "gradsync run: FAILED: state_written_on_some_ranks (rank 1)" in run.output, run.explain()


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
    assert launcher.main(["--doctor-steps", "0", "--run-dir", str(tmp_path), "train.py"], probe=script_check) == 2
    assert "--doctor-steps 0: give the number of optimizer steps to check" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exiting:
        launcher.main(["--doctor-steps", "twenty", "--run-dir", str(tmp_path), "train.py"], probe=script_check)
    assert exiting.value.code == 2
    assert "--doctor-steps: invalid int value: 'twenty'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="at least 1"):
        RunOptions(run_dir=tmp_path, doctor_steps=-3, script_probe=script_check.__name__)


def test_doctor_steps_and_checks_reach_the_workers_through_the_options_file(tmp_path):
    assert RunOptions.load(RunOptions(run_dir=tmp_path, doctor_steps=7, script_probe=script_check.__name__).save()).doctor_steps == 7
    assert RunOptions.load(RunOptions(run_dir=tmp_path).save()).doctor_steps is None
    selected = RunOptions(run_dir=tmp_path, doctor_steps=7, script_probe=script_check.__name__, doctor_checks=["same_file"])
    assert RunOptions.load(selected.save()).doctor_checks == ["same_file"]
    assert RunOptions.load(RunOptions(run_dir=tmp_path).save()).doctor_checks is None


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
