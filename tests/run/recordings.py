"""Recorded runs of the test zoos' scripts (tests/run/zoo, tests/run/doctor_zoo).

A launched `gradsync run` keeps what its diagnosis was made from (evidence.json, see
gradsync.run.analysis.evidence). Kept here as FOLDER/NAME.json (a folder per test file) with the
version of the script and the launcher options it ran with, it lets `make test` make that
diagnosis again, by the current rules, without launching the script: three Python processes that
import torch, ~20 s of CPU each.
A recording of another version of its script, or of other options, is stale: the test that reads
it fails and names `make zoo-record`, which launches every zoo script and records it again.

What a recording cannot tell (the exit code, what the script printed, how soon a hang was
stopped, which processes were left) is checked on the scripts each test file still launches.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable

import pytest

from gradsync.doctor import script as script_check
from gradsync.run.analysis.evidence import Evidence, read_evidence
from gradsync.run.publish import render
from gradsync.rundir import RunDir, read_json

RECORDED = Path(__file__).parent / "zoo_recorded"


def _version(script: Path) -> str:
    return hashlib.sha256(script.read_bytes()).hexdigest()


def record(key: str, script: Path, options: list[str], run_dir: Path, user_view: dict[str, Any] | None = None) -> None:
    """Keep the evidence of the run in `run_dir` (of `script`, launched with `options`) as `key`'s
    ('FOLDER/NAME': a folder per test file, whose names may be another file's), with what its user
    saw (tests/run/user_view.py) where the test file compares that with plain torchrun."""
    evidence = read_evidence(RunDir(run_dir).attempt_evidence(0))
    assert evidence is not None, f"{run_dir} kept no evidence of its diagnosis"
    keep(key, script, options, {"evidence": evidence.as_dict(), **({"user_view": user_view} if user_view else {})})


def keep(key: str, script: Path, options: list[str], content: dict[str, Any]) -> None:
    """Write `content` as `key`'s recording, of this version of `script` run with `options`."""
    path = RECORDED / f"{key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"script_sha256": _version(script), "options": options, **content}, indent=1, sort_keys=True) + "\n")


def is_current(key: str, script: Path, options: list[str]) -> bool:
    """Whether `key` has a recording of this version of `script` run with `options`."""
    return _stale(key, script, options) is None


def _stale(key: str, script: Path, options: list[str]) -> str | None:
    """Why `key`'s recording cannot stand for this version of `script` run with `options`; None when it can."""
    path = RECORDED / f"{key}.json"
    if not path.exists():
        return f"{key} has no recording ({path})"
    kept = json.loads(path.read_text())
    if kept["script_sha256"] != _version(script):
        return f"{path} was recorded from another version of {script.name}"
    if kept["options"] != options:
        return f"{path} was recorded with options {kept['options']}, the test now uses {options}"
    return None


def recorded(key: str, script: Path, options: list[str]) -> Evidence:
    """The evidence recorded as `key`'s; fails the test when it is missing or stale."""
    return Evidence.from_dict(recording(key, script, options)["evidence"])


def recording(key: str, script: Path, options: list[str]) -> dict[str, Any]:
    """All that was recorded as `key`'s; fails the test when it is missing or stale."""
    stale = _stale(key, script, options)
    if stale is not None:
        pytest.fail(f"{stale}: run `make zoo-record`")
    return json.loads((RECORDED / f"{key}.json").read_text())


def remade(key: str, script: Path, options: list[str]) -> tuple[Evidence, dict[str, Any], str]:
    """`key`'s recorded evidence, the diagnosis made again from it, and that diagnosis's terminal
    block (what a recorded run has for output)."""
    evidence = recorded(key, script, options)
    diagnosis = evidence.diagnose(script_check)
    return evidence, diagnosis, render(diagnosis)


class Runs(dict):
    """name -> run of a test file's scripts: those it launched, and the others made from their
    recordings when a test first asks for them (so a missing or stale recording fails the tests
    that read it, not the session). A run's `live` says which it is."""

    def __init__(self, launched: dict[str, Any], names: list[str], from_recording: Callable[[str], Any]):
        super().__init__(launched)
        self.names = names
        self.from_recording = from_recording

    def __missing__(self, name: str) -> Any:
        if name not in self.names:
            raise KeyError(name)
        self[name] = self.from_recording(name)
        return self[name]

    def launched(self, name: str) -> Any:
        """The run of a script a test needs launched (its exit code, output, timing, processes)."""
        run = self[name]
        assert run.live, f"{name} must be launched (in its file's LIVE): this test checks what only a launched run shows"
        return run

    def live_runs(self) -> list[Any]:
        return [run for run in self.values() if run.live]


def launched_names(mode: str, names: list[str], live: list[str]) -> list[str]:
    """Which of `names` a session launches under --zoo=`mode`: all of them but under 'recorded'."""
    return [name for name in names if mode != "recorded" or name in live]


def _shape(evidence: dict[str, Any]) -> set[str]:
    """The fields a recording's ranks carry: of their snapshots, exit records, recorded
    collectives and --doctor-steps facts (top-level names only: below them, names are data)."""
    fields = set()
    for view in evidence["ranks"].values():
        snapshot = view.get("snapshot") or {}
        fields |= {f"snapshot.{key}" for key in snapshot}
        fields |= {f"exit.{key}" for key in view.get("exit") or {}}
        fields |= {f"record.{key}" for record in snapshot.get("records") or [] for key in record}
    fields |= {f"facts.{key}" for facts in evidence["script_checks"].values() for key in facts}
    return fields


def assert_every_field_recorded(runs: Runs, folder: str) -> None:
    """Fails when the ranks of the launched `runs` record a field that no recording of `folder`
    has: the recordings were made before the ranks recorded it, and are stale."""
    live = set()
    for run in runs.live_runs():
        kept = read_json(RunDir(run.run_dir).attempt_evidence(0))
        live |= _shape(kept) if kept else set()
    recorded_fields = set()
    for path in (RECORDED / folder).glob("*.json"):
        recorded_fields |= _shape(json.loads(path.read_text())["evidence"])
    missing = live - recorded_fields
    assert not missing, f"the ranks now record {sorted(missing)}, which no recording has: run `make zoo-record`"
