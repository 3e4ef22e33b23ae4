"""A checkpoint disk that fills up: the previous checkpoint stays valid, the error names the
folder and the free space, a synchronous save stops the run, a background save lets it go on
and the next save is tried as planned, and no half-written checkpoint is ever taken as valid.
Real Gloo ranks writing to a real 1 MB tmpfs (needs root)."""

from __future__ import annotations

import pytest

from tests.checkpoint.conftest import fill
from tests.checkpoint.train_script import train, train_expecting_error
from tests.harness import launch

pytestmark = pytest.mark.launches  # every test here starts processes


def _committed(root) -> list[str]:
    return sorted(p.parent.name for p in root.glob("step-*/manifest.json"))


def test_a_full_disk_stops_a_synchronous_save_with_the_folder_and_the_space(small_disk, uninterrupted):
    checkpoints = small_disk / "ckpt"
    launch(train, 2, checkpoint_dir=str(checkpoints), stop_after_step=4)
    assert _committed(checkpoints) == ["step-000000003"]
    ballast = fill(small_disk, leave_bytes=4096)

    outcomes = launch(train_expecting_error, 2, checkpoint_dir=str(checkpoints))
    error = outcomes[0]["error"]  # rank 0's own; rank 1 quotes it or its own, never hangs
    assert error.startswith("CheckpointError: the checkpoint of step 6 could not be written to "), error
    assert str(checkpoints / "step-000000006") in error and "No space left on device" in error
    assert "free of" in error and "the newest committed checkpoint, step-000000003, takes" in error
    assert "stays the one to resume from" in error
    assert "error" in outcomes[1]
    # Nothing half-written is left to be mistaken for a checkpoint, and the old one still loads.
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000000003"]

    ballast.unlink()
    resumed = launch(train, 2, checkpoint_dir=str(checkpoints))
    assert [r["sha256"] for r in resumed] == [uninterrupted["sha256"]] * 2


def test_a_full_disk_lets_training_go_on_past_a_background_save_and_the_next_one_is_made(small_disk, uninterrupted):
    checkpoints = small_disk / "ckpt"
    launch(train, 2, checkpoint_dir=str(checkpoints), stop_after_step=4, async_save=True)
    ballast = fill(small_disk, leave_bytes=4096)

    # The save of step 6 fails for want of space; once it is reported, rank 0 frees the space
    # and the save of step 9 is made.
    finished = launch(train, 2, checkpoint_dir=str(checkpoints), async_save=True, ballast=str(ballast))
    assert [r["sha256"] for r in finished] == [uninterrupted["sha256"]] * 2
    failures = [w for w in finished[0]["warnings"] if "could not be written" in w]
    assert len(failures) == 1 and "step-000000006" in failures[0] and "No space left on device" in failures[0]
    assert "Training goes on and the next save is made as planned" in failures[0]
    assert _committed(checkpoints) == ["step-000000009", "step-000000012", "step-000000015"]
    assert not (checkpoints / "step-000000006").exists()
