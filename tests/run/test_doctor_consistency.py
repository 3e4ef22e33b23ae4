"""`gradsync run --doctor-steps K`: the mistakes that leave the replicas identical (or diverge them with
a cause to name), on unmodified scripts of tests/run/doctor_zoo, each against its healthy near-miss.

Each finding must name the rank at fault and the line that did it. The checks' rules themselves are
tested on hand-made facts in tests/run/scriptcheck/.
"""

from __future__ import annotations

import pytest

from tests.conftest import ZOO_OPTION
from tests.run.doctor_harness import assert_as_under_plain_torchrun, assert_failed, assert_warned, guard_of, plain_views, run_all
from tests.run.recordings import Runs, assert_every_field_recorded
from tests.timed_findings import untimed_warning_lines

# name -> (script under tests/run, K)
SCRIPTS = {
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
    "pipeline_dtype_reinterpreted": ("doctor_zoo/pipeline_dtype_reinterpreted.py", 3),
    # The near-misses of the mistakes above, done right:
    "healthy_seeding": ("doctor_zoo/healthy_seeding.py", 20),  # 16 steps: finishes before K
    "healthy_data_split": ("doctor_zoo/healthy_data_split.py", 12),  # into the 2nd epoch's warm-up pass
    "healthy_loss_scale": ("doctor_zoo/healthy_loss_scale.py", 4),
    "healthy_rank0_duties": ("doctor_zoo/healthy_rank0_duties.py", 20),  # 16 steps: finishes before K
    "healthy_pipeline_bf16_link": ("doctor_zoo/healthy_pipeline_bf16_link.py", 3),
}

# The session's fixture makes every run above; pytest's default 300 s is less than they may take.
pytestmark = [pytest.mark.launches, guard_of(SCRIPTS)]

HEALTHY = ["healthy_seeding", "healthy_data_split", "healthy_loss_scale", "healthy_rank0_duties", "healthy_pipeline_bf16_link"]


# Launched under `make test`: a failure (exit code 1, the terminal block) and a healthy run (exit
# code 0); the others are made again from their recordings (tests/run/recordings.py).
LIVE = ["eval_left_on_rank0", "healthy_seeding"]


@pytest.fixture(scope="session")
def doctor(request, tmp_path_factory) -> Runs:
    return run_all(SCRIPTS, LIVE, "doctor_consistency", request.config.getoption(ZOO_OPTION), tmp_path_factory.mktemp("doctor-consistency"))


@pytest.fixture(scope="session")
def plain(request, tmp_path_factory) -> Runs:
    return plain_views(SCRIPTS, request.config.getoption(ZOO_OPTION), tmp_path_factory.mktemp("plain"))


@pytest.mark.launches
@pytest.mark.parametrize("name", SCRIPTS)
def test_each_rank_ends_and_prints_as_under_plain_torchrun_for_the_same_steps(doctor, plain, name):
    assert_as_under_plain_torchrun(doctor[name], plain[name])


@pytest.mark.launches
def test_the_recordings_have_every_field_the_ranks_record_now(doctor):
    assert_every_field_recorded(doctor, "doctor_consistency")


# -- mistakes that leave the replicas identical ------------------------------------------------


def test_generators_seeded_alike_after_ddp_are_named_at_the_seeding_line(doctor):
    run = doctor["shared_seed_after_ddp"]
    finding = run.only("shared_random_draws", "warning")
    assert finding["locations"] == {"0": run.line("seed"), "1": run.line("seed")}, run.explain()
    assert finding["details"]["generator"] == "torch" and finding["details"]["draws_compared"] >= run.steps
    assert_warned(run, "shared_random_draws")


def test_a_generator_on_the_dataset_copied_into_workers(doctor):
    run = doctor["dataset_generator_workers"]
    finding = run.only("dataset_generator_copied", "warning")
    assert finding["locations"] == {"0": run.line("rng"), "1": run.line("rng")}, run.explain()  # where it was made
    assert f"iterated at {run.line('loop')}" in finding["message"]
    assert finding["details"] == {"generators": ["rng"], "workers": 2}
    assert "across its 2 workers" in finding["message"] and "on ranks 0, 1" in finding["message"]
    assert_warned(run, "dataset_generator_copied")


def test_samplers_seeded_per_rank_overlap_and_leave_samples_out(doctor):
    run = doctor["sampler_seed_per_rank"]
    finding = run.only("sampler_overlap", "error")
    assert finding["locations"] == {"0": run.line("sampler"), "1": run.line("sampler")}, run.explain()
    details = finding["details"]  # a partial pass (stopped at step K): the overlap so far, coverage unknown
    assert details["samples"] == 320 and details["drawn_twice"] > 0 and not details["complete"], details
    assert "seeds differ (rank 0: seed=17, rank 1: seed=18)" in finding["message"]
    assert_failed(run, "sampler_overlap")


def test_shuffling_without_a_sampler_overlaps_though_no_batch_is_identical(doctor):
    run = doctor["shuffle_without_sampler"]
    finding = run.only("sampler_overlap", "error")  # no_distributed_sampler needs identical batches
    assert finding["locations"] == {"0": run.line("loop"), "1": run.line("loop")}, run.explain()
    assert "no rank uses a DistributedSampler" in finding["message"] and finding["details"]["drawn_twice"] > 0
    assert_failed(run, "sampler_overlap")


def test_a_random_split_that_differs_per_rank(doctor):
    run = doctor["random_split_per_rank"]
    finding = run.only("data_split_differs", "error")
    assert finding["locations"] == {"0": run.line("split"), "1": run.line("split")}, run.explain()
    assert "without a generator" in finding["message"] and "in rank 1's second one" in finding["message"]
    assert_failed(run, "data_split_differs")


def test_a_loss_divided_by_the_world_size_under_ddp(doctor):
    run = doctor["loss_divided_by_world"]
    finding = run.only("loss_scaled_by_world_size", "warning")
    # Named at the division itself (anomaly mode keeps the first step's forward tracebacks).
    assert finding["locations"] == {"0": run.line("loss"), "1": run.line("loss")}, run.explain()
    assert f"backward at {run.line('backward')}" in finding["message"]
    assert finding["details"] == {"scale": 0.5, "world_size": 2}
    assert_warned(run, "loss_scaled_by_world_size")


def test_pipeline_stages_that_read_each_others_bfloat16_as_float16_are_named_with_both_dtypes(doctor):
    # Same byte count, so the run itself goes on: only the labels of the messages show it.
    run = doctor["pipeline_dtype_reinterpreted"]
    finding = run.only("pipeline_messages_differ", "error")
    assert finding["locations"] == {"0": run.line("first_stage"), "1": run.line("last_stage")}, run.explain()
    assert ("Stage 0 (rank 0) sent its activations as bfloat16[2, 16], and stage 1 (rank 1) received them into "
            "float16[2, 16]; stage 1 (rank 1) sent its gradients as float16[2, 16]") in finding["message"], run.explain()
    assert_failed(run, "pipeline_messages_differ")


def test_rank_0_left_in_eval_mode_is_named_with_its_eval_line(doctor):
    run = doctor["eval_left_on_rank0"]
    finding = run.only("eval_mode_differs", "error")
    assert finding["ranks"] == [0] and finding["locations"] == {"0": run.line("eval")}, run.explain()
    assert finding["details"]["forward"] == 5  # the first training forward after the evaluation at step 4
    assert not run.live or run.returncode == 1, run.explain()
    assert "gradsync run: FAILED: eval_mode_differs (rank 0)" in run.output, run.explain()


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
    assert_failed(run, "parameter_order_differs")


# The clipping changes the update itself; the scheduler first changes its own state (its step count
# at step 2, a step before the learning rate moves): one state everywhere names it from there on.
@pytest.mark.parametrize(("name", "tag", "category", "step", "differs"), [
    ("clip_on_rank0", "clip", "state_written_on_some_ranks", 1, ["gradients"]),
    ("scheduler_on_rank0", "scheduler", "state_written_on_some_ranks", 2, ["schedulers"]),
])
def test_an_update_changed_on_rank_0_only_is_blamed_on_its_call(doctor, name, tag, category, step, differs):
    run = doctor[name]
    finding = run.only(category, "error")
    assert finding["ranks"] == [0] and finding["locations"] == {"0": run.line(tag)}, run.explain()
    assert finding["step"] == step and finding["details"]["differs"] == differs, run.explain()
    assert not run.live or run.returncode == 1, run.explain()
    assert f"gradsync run: FAILED: {category} (rank 0)" in run.output, run.explain()


def test_every_rank_saving_to_the_same_path(doctor):
    run = doctor["same_path_saves"]
    finding = run.only("same_file_written", "error")
    assert finding["locations"] == {"0": run.line("save"), "1": run.line("save")}, run.explain()
    assert finding["details"]["path"].endswith("/model.pt") and "at the same step" in finding["message"]
    assert_failed(run, "same_file_written")


@pytest.mark.parametrize("name", HEALTHY)
def test_healthy_near_misses_get_no_findings(doctor, name):
    run = doctor[name]
    assert not run.live or run.returncode == 0, run.explain()
    assert run.diagnosis["status"] == "ok" and run.findings() == [], run.explain()
    assert "gradsync run: ok: 2 ranks finished" in run.output and untimed_warning_lines(run.output) == [], run.explain()
