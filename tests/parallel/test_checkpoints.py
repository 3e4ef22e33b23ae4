"""Checkpoints under FSDP, HSDP and tensor parallelism: sharded DCP state, bitwise resume on the
same world size, resume onto another one (resharded) with every sample seen once, and a
checkpoint of one strategy refused by another with the reason."""

from __future__ import annotations

import pytest

from tests.checkpoint.train_script import SAMPLES, train, train_expecting_error
from tests.harness import launch

pytestmark = pytest.mark.launches  # every test here starts processes

# (strategy, ranks): 2-D meshes are 2 x 2.
CASES = [("fsdp", 2), ("hsdp", 4), ("tp", 2), ("fsdp+tp", 4)]


@pytest.mark.parametrize(("parallel", "ranks"), CASES, ids=[c[0] for c in CASES])
def test_an_interrupted_sharded_run_resumes_bitwise(tmp_path, parallel, ranks):
    uninterrupted = launch(train, ranks, checkpoint_dir=None, parallel=parallel, timeout=150)
    checkpoints = tmp_path / "ckpt"
    steps = uninterrupted[0]["steps"]
    first = launch(train, ranks, checkpoint_dir=str(checkpoints), parallel=parallel, stop_after_step=steps // 2 + 1,
                   timeout=150)
    assert first[0]["steps"] == steps // 2 + 1
    second = launch(train, ranks, checkpoint_dir=str(checkpoints), parallel=parallel, timeout=150)
    assert {r["sha256"] for r in second} == {uninterrupted[0]["sha256"]}, "bitwise equal to the run that never stopped"
    assert second[0]["summary_steps"] == steps and second[0]["counter"] == steps
    assert not [w for r in second for w in r["warnings"]]


def test_fsdp_resumes_on_another_world_size_resharded_with_each_sample_once(tmp_path):
    checkpoints = tmp_path / "ckpt"
    # 4 ranks: 30 samples each, 4 batches of 8 (the last of 6), 2 steps per epoch. The newest
    # checkpoint, step 3's, is one step (2 batches of 8 per rank) into epoch 1.
    first = launch(train, 4, checkpoint_dir=str(checkpoints), parallel="fsdp", stop_after_step=5, one_cycle=False,
                   timeout=150)
    before = [i for rank in first for i in rank["seen"]["1"][: 2 * 8]]
    after = launch(train, 2, checkpoint_dir=str(checkpoints), parallel="fsdp", one_cycle=False, timeout=150)
    rest = [i for rank in after for i in rank["seen"]["1"]]
    assert len(before) == 64 and len(rest) == SAMPLES - 64
    assert sorted(before + rest) == list(range(SAMPLES))
    for epoch in ("2", "3"):
        assert sorted(i for rank in after for i in rank["seen"][epoch]) == list(range(SAMPLES))
    assert len({r["sha256"] for r in after}) == 1, "the resharded parameters and optimizer state agree"
    assert any("written by 4 ranks" in w for w in after[0]["warnings"])


def test_a_checkpoint_of_one_strategy_is_refused_by_another_with_the_reason(tmp_path):
    checkpoints = tmp_path / "ckpt"
    launch(train, 2, checkpoint_dir=str(checkpoints), parallel="fsdp", stop_after_step=4, timeout=150)
    refused = launch(train_expecting_error, 2, checkpoint_dir=str(checkpoints), parallel="ddp", timeout=150)
    assert "written with parallel='fsdp'" in refused[0]["error"] and "Resume with parallel='fsdp'" in refused[0]["error"]


@pytest.mark.parametrize(("written", "resumed"), [(("fsdp", 2), ("tp", 2)), (("hsdp", 4), ("fsdp", 2))],
                         ids=["fsdp-2-to-tp-2", "hsdp-4-to-fsdp-2"])
def test_a_sharded_run_resumes_under_another_sharded_strategy_with_each_sample_once(tmp_path, written, resumed):
    # DCP reshards parameters and optimizer state onto the new layout; the loader re-divides the
    # rest of the epoch over the new data-parallel ranks; each rank's own random stream is not
    # taken back (a tensor-parallel pair must draw alike), as on a world-size change.
    checkpoints = tmp_path / "ckpt"
    launch(train, written[1], checkpoint_dir=str(checkpoints), parallel=written[0], stop_after_step=5, one_cycle=False,
           timeout=150)
    after = launch(train, resumed[1], checkpoint_dir=str(checkpoints), parallel=resumed[0], one_cycle=False, timeout=150)
    data_ranks = after[:1] if resumed[0] == "tp" else after  # a tensor-parallel pair shares its batches
    for epoch in ("2", "3"):
        assert sorted(i for r in data_ranks for i in r["seen"][epoch]) == list(range(SAMPLES))
    assert len({r["sha256"] for r in after}) == 1
    note = "written with parallel='fsdp', this run uses 'tp'" if written[1] == resumed[1] else "written by 4 ranks, this run has 2"
    assert any(note in w for w in after[0]["warnings"]), after[0]["warnings"]


def test_a_lone_process_trains_sharded_and_a_launched_job_resumes_its_checkpoint(tmp_path):
    # `python train.py` with parallel="fsdp": a one-rank group of its own (no launcher, no peers),
    # so its checkpoints are sharded ones, which 2 launched ranks resume resharded.
    checkpoints = tmp_path / "ckpt"
    (alone,) = launch(train, 1, launcher=False, checkpoint_dir=str(checkpoints), parallel="fsdp", stop_after_step=5,
                      one_cycle=False, timeout=150)
    assert alone["steps"] == 5
    after = launch(train, 2, checkpoint_dir=str(checkpoints), parallel="fsdp", one_cycle=False, timeout=150)
    assert any("written by 1 ranks, this run has 2" in w for w in after[0]["warnings"]), after[0]["warnings"]
    for epoch in ("2", "3"):
        assert sorted(i for r in after for i in r["seen"][epoch]) == list(range(SAMPLES))
