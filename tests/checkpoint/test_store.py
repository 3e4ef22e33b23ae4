"""The checkpoint folder: commit marker written last, checksums, pruning."""

from __future__ import annotations

import json

import pytest

from gradsync.checkpoint import store


def _fake_save(root, step, world_size=2, commit=True):
    path = store.step_dir(root, step)
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"index")
    for rank in range(world_size):
        (path / f"__{rank}_0.distcp").write_bytes(bytes([rank]) * 100)
        store.write_rank_checksums(path, rank)
    if commit:
        store.commit(path, {"step": step, "world_size": world_size}, world_size)
    return path


def test_commit_folds_every_ranks_checksums_into_the_manifest(tmp_path):
    path = _fake_save(tmp_path, 5)
    manifest = store.read_manifest(path)
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert manifest["files"]["__1_0.distcp"]["bytes"] == 100
    assert not list(path.glob("checksums-*"))
    assert store.verify_files(path, manifest, sorted(manifest["files"])) == []
    (path / "__1_0.distcp").write_bytes(bytes([9]) * 100)
    (path / "__0_0.distcp").unlink()
    problems = store.verify_files(path, manifest, sorted(manifest["files"]))
    assert problems == [f"{path / '__0_0.distcp'} is missing", f"{path / '__1_0.distcp'} does not match its checksum (corrupted or replaced)"]


def test_an_uncommitted_folder_is_not_a_checkpoint(tmp_path):
    path = _fake_save(tmp_path, 5, commit=False)
    with pytest.raises(store.CheckpointError, match="save never finished"):
        store.read_manifest(path)


def test_prune_keeps_the_newest_and_drops_dead_saves(tmp_path):
    for step in (1, 2, 3, 4):
        _fake_save(tmp_path, step)
    _fake_save(tmp_path, 0, commit=False)  # died long ago
    _fake_save(tmp_path, 9, commit=False)  # still being written (async): must stay
    store.prune(tmp_path, keep=2, newest_step=4)
    assert [step for step, _ in store.checkpoint_dirs(tmp_path)] == [9, 4, 3]


def test_prune_never_counts_checkpoints_the_run_has_not_reached(tmp_path):
    # Folders of later steps are not this run's own (it has not saved them yet): counting them
    # as the newest would delete the run's fresh saves right after writing them.
    for step in (9, 12, 15, 3, 6):
        _fake_save(tmp_path, step)
    assert store.prune(tmp_path, keep=2, newest_step=6) == []
    assert store.prune(tmp_path, keep=1, newest_step=6) == [tmp_path / "step-000000003"]
    assert [step for step, _ in store.checkpoint_dirs(tmp_path)] == [15, 12, 9, 6]


def test_newer_format_names_both_versions(tmp_path):
    path = _fake_save(tmp_path, 1)
    manifest = json.loads((path / store.MANIFEST).read_text())
    (path / store.MANIFEST).write_text(json.dumps({**manifest, "format": 2, "gradsync_version": "0.9"}))
    with pytest.raises(store.NewerFormatError, match=r"format 2 by gradsync 0\.9; this gradsync \(.*\) reads format 1"):
        store.read_manifest(path)


def test_files_swapped_between_ranks_or_checkpoints_are_caught(tmp_path):
    path = _fake_save(tmp_path, 5)
    older = _fake_save(tmp_path, 4)
    manifest = store.read_manifest(path)
    a, b = path / "__0_0.distcp", path / "__1_0.distcp"
    a_bytes, b_bytes = a.read_bytes(), b.read_bytes()
    a.write_bytes(b_bytes)
    b.write_bytes(a_bytes)  # same sizes, swapped contents
    assert len(store.verify_files(path, manifest, sorted(manifest["files"]))) == 2
    a.write_bytes(a_bytes)
    b.write_bytes(b_bytes)
    (path / ".metadata").write_bytes((older / ".metadata").read_bytes() + b"x")  # another checkpoint's index
    assert store.verify_files(path, manifest, [".metadata"]) == [
        f"{path / '.metadata'} has 6 bytes, the manifest says 5 (truncated or replaced)"
    ]
