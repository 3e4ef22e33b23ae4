"""Checkpoints of two runs never mix in one folder: a run that would continue neither refuses to
start, unless told to overwrite, and never deletes a checkpoint it just wrote."""

from __future__ import annotations

from pathlib import Path

import pytest

from gradsync.checkpoint import CheckpointConfig
from gradsync.errors import ConfigError
from tests.checkpoint.train_script import train, train_expecting_error
from tests.harness import launch


def _steps(root: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step-")) for p in root.glob("step-*") if (p / "manifest.json").exists())


@pytest.fixture(scope="module")
def older_run(tmp_path_factory) -> Path:
    """A folder an earlier run (1 rank, 32 steps) left its checkpoints of steps 24, 27 and 30 in (every 3 steps, keep 3)."""
    folder = tmp_path_factory.mktemp("older") / "ckpt"
    launch(train, 1, checkpoint_dir=str(folder), resume=None)
    assert _steps(folder) == [24, 27, 30]
    return folder


def _copy(folder: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(folder, tmp_path / "ckpt"))


@pytest.mark.launches
def test_a_fresh_run_refuses_a_folder_with_another_runs_checkpoints(older_run, tmp_path):
    folder = _copy(older_run, tmp_path)
    outcomes = launch(train_expecting_error, 2, checkpoint_dir=str(folder), resume=None)
    rank0 = outcomes[0]["error"]
    assert rank0.startswith(f"CheckpointError: checkpoint.dir {folder} already holds checkpoints of another run (steps 24, 27, 30)")
    for way_out in ("resume='auto'", "another checkpoint.dir", "checkpoint.overwrite=True"):
        assert way_out in rank0
    assert "error" in outcomes[1], "every rank stops, none is left waiting"
    assert _steps(folder) == [24, 27, 30], "nothing was touched"


@pytest.mark.launches
def test_overwrite_removes_the_other_run_before_the_first_save(older_run, tmp_path):
    # Without the refusal, keep-newest counted the older run's 24, 27 and 30 and deleted this
    # run's 3 and 6 right after saving them; a crash then resume="auto" continued the old run.
    folder = _copy(older_run, tmp_path)
    [result] = launch(train, 1, checkpoint_dir=str(folder), resume=None, overwrite=True, stop_after_step=7)
    assert result["steps"] == 7
    assert _steps(folder) == [3, 6]
    assert not (folder / "step-000000030").exists()


@pytest.mark.launches
def test_resuming_from_an_older_checkpoint_of_the_folder_refuses_its_newer_ones(older_run, tmp_path):
    folder = _copy(older_run, tmp_path)
    older = str(folder / "step-000000024")
    [outcome] = launch(train_expecting_error, 1, checkpoint_dir=str(folder), resume=older)
    assert "newer than step 24, the one this run resumes from (steps 27, 30)" in outcome["error"]
    assert _steps(folder) == [24, 27, 30]
    [result] = launch(train, 1, checkpoint_dir=str(folder), resume=older, overwrite=True, stop_after_step=26)
    assert result["steps"] == 26 and _steps(folder) == [24]
    [result] = launch(train, 1, checkpoint_dir=str(folder), resume="auto")
    assert result["steps"] == 32 and _steps(folder) == [24, 27, 30]  # resume="auto" leaves nothing foreign


def test_resume_is_auto_or_an_existing_folder(tmp_path):
    with pytest.raises(ConfigError, match=r"checkpoint.resume='latest' is neither 'auto' nor an existing checkpoint folder"):
        CheckpointConfig(dir=str(tmp_path), resume="latest")
    assert CheckpointConfig(dir=tmp_path, resume=tmp_path).resume == str(tmp_path)  # paths are kept as text
    with pytest.raises(ConfigError, match="checkpoint.dir is not"):
        CheckpointConfig(overwrite=True)
