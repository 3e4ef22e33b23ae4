"""Exact resume on real Gloo process groups: an interrupted run that resumes ends bitwise equal
to one that never stopped; broken checkpoints are skipped or refused with clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.checkpoint.train_script import SAMPLES, train, train_expecting_error
from tests.harness import launch

pytestmark = pytest.mark.launches  # every test here starts processes


def _steps(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir())


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_interrupted_run_resumes_bitwise(tmp_path, uninterrupted, async_save):
    checkpoints = tmp_path / "ckpt"
    first = launch(train, 2, checkpoint_dir=str(checkpoints), stop_after_step=7, async_save=async_save)
    assert first[0]["steps"] == 7
    assert _steps(checkpoints) == ["step-000000003", "step-000000006"]
    assert all((checkpoints / name / "manifest.json").exists() for name in _steps(checkpoints))
    second = launch(train, 2, checkpoint_dir=str(checkpoints), async_save=async_save)
    assert [r["sha256"] for r in second] == [uninterrupted["sha256"]] * 2
    # The resumed run starts in epoch 1 (4 steps per epoch) right after step 6's batches, and
    # reports every step once.
    assert second[0]["seen"]["1"] == uninterrupted["seen"]["1"][4 * 8 :]
    assert second[0]["summary_steps"] == uninterrupted["summary_steps"] == 16
    assert second[0]["counter"] == uninterrupted["counter"] == 16  # the user's registered object
    manifest = json.loads((checkpoints / "step-000000015" / "manifest.json").read_text())
    assert manifest["step"] == 15 and manifest["world_size"] == 2 and manifest["format"] == 1
    assert manifest["config"]["accumulation_steps"] == 2 and manifest["data"]["epoch"] == 3
    assert manifest["model"]["0.weight"] == [[64, 8], "float32"]
    assert _steps(checkpoints) == ["step-000000009", "step-000000012", "step-000000015"]  # keep=3


def test_resume_on_another_world_size_sees_each_sample_once(tmp_path):
    checkpoints = tmp_path / "ckpt"
    first = launch(train, 2, checkpoint_dir=str(checkpoints), stop_after_step=5)
    # The checkpoint of step 3 is in epoch 0 after 6 batches of 8 on each of 2 ranks: the first
    # 96 samples of the epoch's order. Three ranks share the other 24.
    before = [i for rank in first for i in rank["seen"]["0"][: 6 * 8]]
    after = launch(train, 3, checkpoint_dir=str(checkpoints))
    rest = [i for rank in after for i in rank["seen"]["0"]]
    assert len(rest) == SAMPLES - 96
    assert sorted(before + rest) == list(range(SAMPLES))
    for epoch in ("1", "2", "3"):  # later epochs: the usual 3-way split, each sample once
        assert sorted(i for rank in after for i in rank["seen"][epoch]) == list(range(SAMPLES))
    assert len({r["sha256"] for r in after}) == 1


def test_broken_checkpoints_are_skipped_then_refused(tmp_path, uninterrupted):
    checkpoints = tmp_path / "ckpt"
    launch(train, 2, checkpoint_dir=str(checkpoints), stop_after_step=7)
    newest = checkpoints / "step-000000006"
    data = sorted(newest.glob("__*_0.distcp"))[0]
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])  # truncated
    unfinished = checkpoints / "step-000000007"
    shutil.copytree(checkpoints / "step-000000003", unfinished)
    (unfinished / "manifest.json").unlink()  # a save that never committed

    # The truncated step 6 and the unfinished step 7 are skipped: step 3 is just as exact.
    resumed = launch(train, 2, checkpoint_dir=str(checkpoints), stop_after_step=4, every_steps=None)
    assert resumed[0]["steps"] == 4

    oldest = checkpoints / "step-000000003" / ".metadata"
    blob = bytearray(oldest.read_bytes())
    blob[-5] ^= 0xFF  # same size, altered content
    oldest.write_bytes(bytes(blob))
    [outcome] = launch(train_expecting_error, 1, checkpoint_dir=str(checkpoints))
    assert outcome["error"].startswith("CheckpointError: no valid checkpoint to resume from")
    assert str(data) in outcome["error"] and "truncated" in outcome["error"]
    assert str(oldest) in outcome["error"] and "checksum" in outcome["error"]


def test_other_model_and_newer_format_are_refused(tmp_path):
    checkpoints = tmp_path / "ckpt"
    launch(train, 1, checkpoint_dir=str(checkpoints), stop_after_step=3)
    [outcome] = launch(train_expecting_error, 1, checkpoint_dir=str(checkpoints), hidden=32)
    assert "saved from a different model" in outcome["error"]
    assert "0.weight [64, 8] saved vs [32, 8] now" in outcome["error"]

    manifest_path = checkpoints / "step-000000003" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest.update(format=99, gradsync_version="9.0")
    manifest_path.write_text(json.dumps(manifest))
    [outcome] = launch(train_expecting_error, 1, checkpoint_dir=str(checkpoints))
    assert outcome["error"].startswith("NewerFormatError")
    assert "format 99 by gradsync 9.0" in outcome["error"] and "reads format 1" in outcome["error"]


def test_time_based_saves_happen_at_the_same_step_on_every_rank(tmp_path):
    # Rank 0's clock decides; were the ranks to save at different steps, DCP's collectives
    # would pair up wrongly and the run would hang or fail.
    results = launch(train, 2, checkpoint_dir=str(tmp_path), every_steps=None, every_minutes=0.002, step_delay_s=0.05)
    assert results[0]["saves"] == results[1]["saves"] >= 3
    assert len(list(tmp_path.glob("step-*/manifest.json"))) == 3  # keep=3


def train_deep(run_dir, checkpoint_dir, epochs, compression, save_after_epoch=None, resume=None, bucket_cap_mb=0.05):
    """Four layers in several small buckets, whose order and sizes DDP changes after the first
    backward."""
    import torch
    import torch.nn.functional as F

    import gradsync

    trainer = gradsync.setup(
        seed=0, run_dir=run_dir,
        ddp={"compression": {"name": compression, "powersgd_start_step": 2, "min_numel": 16}, "bucket_cap_mb": bucket_cap_mb},
        metrics={"progress": False, "tensorboard": False, "system_every_s": None},
        checkpoint={"dir": checkpoint_dir, "resume": resume} if checkpoint_dir else {},
    )
    generator = torch.Generator().manual_seed(7)
    dataset = torch.utils.data.TensorDataset(
        torch.randn(40 * trainer.world_size, 4, generator=generator, dtype=torch.float64),
        torch.randn(40 * trainer.world_size, 1, generator=generator, dtype=torch.float64),
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 128), torch.nn.Tanh(), torch.nn.Linear(128, 128), torch.nn.Tanh(),
        torch.nn.Linear(128, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1),
    ).double()
    model, optimizer, loader = trainer.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05), dataset, batch_size=2)
    for epoch in trainer.epochs(epochs):
        for x, y in loader:
            with trainer.step() as step:
                step.backward(F.mse_loss(model(x), y))
        if epoch == save_after_epoch:
            trainer.save_checkpoint()
    parameters = torch.cat([p.detach().reshape(-1) for p in trainer.unwrap(model).parameters()]).tolist()
    trainer.close()
    return parameters


@pytest.mark.parametrize("compression", ["int8", "topk", "powersgd"])
def test_compressed_run_resumes_bitwise_on_three_ranks(tmp_path, compression):
    # Saved after DDP rebuilt its buckets, with int8's residuals and scales agreed for the next
    # step, top-k's residuals, PowerSGD's error and factors: the resumed run reduces in the same
    # layout (gradsync.bucket_layout) and finds each piece of state on its parameters.
    checkpoints = str(tmp_path / "ckpt")
    uninterrupted = launch(train_deep, 3, run_dir=str(tmp_path / "a"), checkpoint_dir=checkpoints, epochs=3,
                           compression=compression, save_after_epoch=1)
    resumed = launch(train_deep, 3, run_dir=str(tmp_path / "b"), checkpoint_dir=checkpoints, epochs=3,
                     compression=compression, resume="auto")
    assert resumed == uninterrupted


@pytest.mark.parametrize("world_size,async_save", [(3, True), (4, False)], ids=["3-ranks-async", "4-ranks-sync"])
def test_interrupted_run_resumes_bitwise_on_more_ranks(tmp_path, world_size, async_save):
    # From three ranks on, the ring all-reduce's order of additions depends on DDP's bucket
    # layout: without restoring it, the resumed run differs in the last bits (gradsync.bucket_layout).
    reference = launch(train, world_size, checkpoint_dir=None)
    checkpoints = tmp_path / "ckpt"
    launch(train, world_size, checkpoint_dir=str(checkpoints), stop_after_step=5, async_save=async_save)
    assert (checkpoints / "step-000000003" / "manifest.json").exists()
    resumed = launch(train, world_size, checkpoint_dir=str(checkpoints), async_save=async_save)
    assert [r["sha256"] for r in resumed] == [reference[0]["sha256"]] * world_size
    assert resumed[0]["summary_steps"] == reference[0]["summary_steps"]
