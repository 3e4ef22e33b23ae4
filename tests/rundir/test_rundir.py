"""The run folder: every path named once, atomic writes, readers that survive damage, one owner."""

from pathlib import Path

import pytest

from gradsync import rundir
from gradsync.rundir import RingWriter, RunDir, read_attempt, read_ring, write_json
from gradsync.rundir.records import RECORD_FIELDS


def test_attempt_files_are_read_back_by_rank(tmp_path):
    run = RunDir(tmp_path)
    write_json(run.snapshot(0, 1), {"rank": 1})
    write_json(run.exit_record(0, 1), {"rank": 1, "exit": {"status": "finished"}})
    write_json(run.snapshot(2, 0), {"rank": 0})
    run.snapshot(2, 1).write_text("{half a fi")
    assert run.latest_attempt() == 2
    snapshots, exits = read_attempt(run, 0)
    assert snapshots[1]["rank"] == 1 and exits[1]["exit"]["status"] == "finished"
    snapshots, exits = read_attempt(run, 2)
    assert list(snapshots) == [0] and exits == {}, "an unreadable file is skipped, not fatal"
    assert not list(run.attempt(0).glob(".*tmp")), "writes are atomic renames"


class _Record:
    def __init__(self, index, signature="float32[4]"):
        for name in (*RECORD_FIELDS, "ring_prefix"):
            setattr(self, name, None)
        self.entered = 1764500000.25
        self.index, self.group, self.seq, self.op, self.signature, self.state = index, "default", index + 1, "all_reduce", signature, "entered"


def test_ring_file_keeps_the_last_records_and_survives_its_writer(tmp_path):
    run = RunDir(tmp_path)
    ring = RingWriter(run.ring(0, 0), slots=16)
    for index in range(40):
        ring.write(_Record(index))
    ring.write(_Record(40, signature="x" * 5000))  # too big for a slot: shortened, not lost
    del ring  # the data is in the file, whatever happens to the process
    records = read_ring(run.ring(0, 0))
    assert [r["index"] for r in records] == list(range(25, 41))
    assert records[-1]["signature"] == "x" * 200 and records[0]["state"] == "entered"
    assert records[0]["entered"] == 1764500000.25 and records[0]["finished"] is None
    write_json(run.snapshot(0, 0), {"rank": 0})
    snapshots, _ = read_attempt(run, 0)
    assert snapshots[0]["collectives"] == 41 and len(snapshots[0]["records"]) == 16


def test_a_relaunch_in_the_same_run_dir_archives_the_earlier_records(tmp_path):
    run = RunDir(tmp_path)
    assert run.archive_previous_launch() is None
    write_json(run.exit_record(0, 1), {"exit": {"status": "exit_code", "code": 143}})
    write_json(run.diagnosis, {"status": "stopped"})
    run.launcher_log.write_text("agent lines\n")
    archive = run.archive_previous_launch()
    assert archive is not None and archive.parent == run.previous
    assert run.latest_attempt() is None and not run.diagnosis.exists() and not run.launcher_log.exists()
    moved = RunDir(archive)
    assert moved.exit_record(0, 1).exists() and moved.diagnosis.exists() and moved.launcher_log.exists()


@pytest.fixture
def no_inherited_folder(monkeypatch):
    monkeypatch.setattr(rundir.layout, "_inherited", None)


def test_one_rule_chooses_the_folder(tmp_path, monkeypatch, no_inherited_folder):
    monkeypatch.chdir(tmp_path)
    fresh, note = rundir.choose(None)
    assert fresh.parent == Path("gradsync_runs") and note is None and not fresh.exists()
    assert rundir.choose("mine") == (Path("mine"), None)
    # Under gradsync run, the launcher's folder wins: the metrics land beside the diagnosis.
    rundir.inherit(Path("launched"))
    assert rundir.choose(None) == (tmp_path / "launched", None)
    assert rundir.choose(tmp_path / "launched") == (tmp_path / "launched", None)
    chosen, note = rundir.choose("elsewhere")
    assert chosen == tmp_path / "launched" and "run_dir='elsewhere' is not used: gradsync run chose" in note


@pytest.mark.launches
def test_a_trainer_under_gradsync_run_writes_into_the_launchers_folder(tmp_path, no_inherited_folder):
    import gradsync

    rundir.inherit(tmp_path / "launched")
    trainer = gradsync.setup(metrics={"progress": False, "tensorboard": False, "system_every_s": None})
    try:
        assert trainer.run_dir == tmp_path / "launched"
    finally:
        trainer.close()
