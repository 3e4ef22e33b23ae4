"""What a diagnosis was made from, kept and read back: the same diagnosis made again."""

import json

import pytest

from gradsync.doctor import script as script_check
from gradsync.run.analysis.evidence import FORMAT, Evidence, read_evidence
from gradsync.run.analysis.last_words import classify
from gradsync.run.analysis.rules import diagnose
from gradsync.rundir.records import Finding
from tests.run.test_analysis import exception, record, view
from tests.doctor.script.facts import script_facts

GLOO_ABORT = """terminate called after throwing an instance of 'gloo::EnforceNotMet'
  what():  [enforce fail at pair.cc:446] op.preamble.length <= op.nbytes. 48 vs 32"""


def _evidence() -> Evidence:
    views = {
        0: view(0, [record(1), record(2, state="failed")], exit=exception("Connection closed by peer", time=12.0), exitcode=1),
        1: view(1, [record(1), record(2, state="entered")], exitcode=-6, signal="SIGABRT"),
    }
    views[1].last_words = classify(GLOO_ABORT)
    views[0].stopped_by_gradsync = True
    straggler = Finding("straggler", "warning", [1], "rank 1 is slow", "look at rank 1")
    facts = {rank: script_facts(syncs_per_step=[4, 4, 4, 4]) for rank in (0, 1)}  # accumulation without no_sync
    return Evidence(views, trigger="failure", now=20.0, world_size=2, stragglers=[straggler], script_checks=facts)


def test_kept_evidence_read_back_gives_the_same_diagnosis():
    evidence = _evidence()
    kept = Evidence.from_dict(json.loads(json.dumps(evidence.as_dict())))
    assert kept.diagnose(script_check) == evidence.diagnose(script_check)
    assert kept.views[1].last_words == evidence.views[1].last_words and kept.views[1].last_words.family == "collective_mismatch"
    assert kept.views[0].stopped_by_gradsync and kept.views[1].signal == "SIGABRT"


def test_the_diagnosis_is_the_rules_on_the_views_and_the_facts():
    evidence = _evidence()
    made = evidence.diagnose(script_check)
    direct = diagnose(evidence.views, trigger="failure", now=20.0, world_size=2, stragglers=evidence.stragglers,
                      script_check=script_check.findings(evidence.script_checks))
    assert made == direct
    assert {"straggler", "accumulation_without_no_sync"} <= {f["category"] for f in made["findings"]}


def test_evidence_of_another_format_is_refused_and_a_missing_file_is_none(tmp_path):
    data = _evidence().as_dict()
    with pytest.raises(ValueError, match=f"reads format {FORMAT}"):
        Evidence.from_dict({**data, "format": FORMAT + 1})
    assert read_evidence(tmp_path / "evidence.json") is None
    (tmp_path / "evidence.json").write_text(json.dumps(data))
    assert read_evidence(tmp_path / "evidence.json").diagnose(script_check) == _evidence().diagnose(script_check)
