"""Run options, the run-directory files workers and launcher share, and finding the user's line."""

import json
import sys

import pytest

from gradsync.errors import ConfigError
from gradsync.run import files
from gradsync.run.callsite import caller_location, innermost_user_location, is_user_file
from gradsync.run.options import RunOptions


def test_options_round_trip_and_validation(tmp_path):
    options = RunOptions(run_dir=tmp_path, stall_timeout_s=5, record_buckets=True, profile_steps="3:5")
    assert RunOptions.load(options.save()) == options
    assert options.snapshot_interval_s == 1.0
    assert RunOptions(run_dir=tmp_path, stall_timeout_s=2).snapshot_interval_s == pytest.approx(0.4)
    with pytest.raises(ConfigError, match="at least 1 second"):
        RunOptions(run_dir=tmp_path, stall_timeout_s=0.5)
    with pytest.raises(ConfigError, match="--profile-steps '3': give FIRST:LAST"):
        RunOptions(run_dir=tmp_path, profile_steps="3")
    (tmp_path / "bad.json").write_text("[]")
    with pytest.raises(ConfigError, match="not a gradsync run options file"):
        RunOptions.load(tmp_path / "bad.json")


def test_attempt_files_are_read_back_by_rank(tmp_path):
    files.write_json(files.snapshot_path(tmp_path, 0, 1), {"rank": 1})
    files.write_json(files.exit_path(tmp_path, 0, 1), {"rank": 1, "exit": {"status": "finished"}})
    files.write_json(files.snapshot_path(tmp_path, 2, 0), {"rank": 0})
    (files.attempt_dir(tmp_path, 2) / "rank1.json").write_text("{half a fi")
    assert files.latest_attempt(tmp_path) == 2
    snapshots, exits = files.read_attempt(tmp_path, 0)
    assert snapshots[1]["rank"] == 1 and exits[1]["exit"]["status"] == "finished"
    snapshots, exits = files.read_attempt(tmp_path, 2)
    assert list(snapshots) == [0] and exits == {}, "an unreadable file is skipped, not fatal"
    assert not list(files.attempt_dir(tmp_path, 0).glob(".*tmp")), "writes are atomic renames"


def test_user_frames_skip_torch_gradsync_and_the_standard_library():
    import json as stdlib_module

    import torch

    assert is_user_file(__file__)
    assert not is_user_file(torch.__file__)
    assert not is_user_file(files.__file__)
    assert not is_user_file(stdlib_module.__file__)
    assert caller_location().endswith(f"test_options_and_files.py:{sys._getframe().f_lineno}")
    assert innermost_user_location([(__file__, 3), (torch.__file__, 9)]).endswith("test_options_and_files.py:3")


class _Record:
    def __init__(self, index, signature="float32[4]"):
        for name in (*files.RECORD_FIELDS, "ring_prefix"):
            setattr(self, name, None)
        self.entered = 1764500000.25
        self.index, self.group, self.seq, self.op, self.signature, self.state = index, "default", index + 1, "all_reduce", signature, "entered"


def test_ring_file_keeps_the_last_records_and_survives_its_writer(tmp_path):
    path = files.ring_path(tmp_path, 0, 0)
    ring = files.RingWriter(path, slots=16)
    for index in range(40):
        ring.write(_Record(index))
    ring.write(_Record(40, signature="x" * 5000))  # too big for a slot: shortened, not lost
    del ring  # the data is in the file, whatever happens to the process
    records = files.read_ring(path)
    assert [r["index"] for r in records] == list(range(25, 41))
    assert records[-1]["signature"] == "x" * 200 and records[0]["state"] == "entered"
    assert records[0]["entered"] == 1764500000.25 and records[0]["finished"] is None
    files.write_json(files.snapshot_path(tmp_path, 0, 0), {"rank": 0})
    snapshots, _ = files.read_attempt(tmp_path, 0)
    assert snapshots[0]["collectives"] == 41 and len(snapshots[0]["records"]) == 16


def test_a_relaunch_in_the_same_run_dir_archives_the_earlier_records(tmp_path):
    assert files.archive_previous_launch(tmp_path) is None
    files.write_json(files.exit_path(tmp_path, 0, 1), {"exit": {"status": "exit_code", "code": 143}})
    files.write_json(tmp_path / files.DIAGNOSIS_FILE, {"status": "stopped"})
    archive = files.archive_previous_launch(tmp_path)
    assert archive is not None and archive.parent == tmp_path / "previous"
    assert files.latest_attempt(tmp_path) is None and not (tmp_path / files.DIAGNOSIS_FILE).exists()
    assert (archive / "workers" / "attempt0" / "rank1.exit.json").exists() and (archive / files.DIAGNOSIS_FILE).exists()
