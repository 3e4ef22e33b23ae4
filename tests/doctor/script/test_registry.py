"""The registry of the script check's checks: one list of checks, from which come the categories of
diagnosis.json, the docs table, the `--checks` names, and the findings (less those another explains)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gradsync.errors import ConfigError
from gradsync.rundir import records
from gradsync.rundir.records import SEVERITIES, Finding
from gradsync.run.harmless import BookkeepingByKind
from gradsync.doctor.script import registry
from gradsync.run.moments import Moments
from tests.doctor.script.facts import (
    consistency_facts,
    draw,
    drawing,
    findings,
    loader,
    model,
    script_facts,
    step_taken,
)
from tests.doctor.script.test_data_split import split

DOCS = Path(__file__).resolve().parents[3] / "docs" / "doctor.md"


def _categories(found: list[Finding]) -> list[str]:
    return [finding.category for finding in found]


# -- what the checks declare --------------------------------------------------------------------


def test_every_check_has_a_unique_name_and_categories_no_other_check_has():
    names = registry.check_names()
    assert len(names) == len(set(names)), names
    owned = [name for check in registry.CHECKS for name in check.categories]
    assert len(owned) == len(set(owned)), owned
    assert all(name.isidentifier() and name == name.lower() for name in names), names  # typed after --checks


def test_every_category_has_severities_a_meaning_and_a_doc():
    for name, category in registry.categories().items():
        assert category.severities and set(category.severities) <= set(SEVERITIES), name
        assert category.meaning.strip() and category.doc.strip(), name
        assert "|" not in category.doc and "\n" not in category.doc, f"{name}: its doc is one cell of a table row"


def test_each_watch_records_exactly_the_facts_its_check_declares():
    for check in registry.CHECKS:
        if check.watch is None:
            continue
        watch = check.watch(Moments(), BookkeepingByKind())
        assert set(watch.facts()) == set(check.facts.__annotations__), check.name
        assert check.facts.__required_keys__ == set(check.facts.__annotations__), check.name


def test_what_a_check_explains_is_a_category_of_the_checks_or_of_gradsync_run():
    known = set(records.CATEGORIES)  # the run's own and, once the registry is imported, the checks'
    assert set(registry.categories()) <= known
    for check in registry.CHECKS:
        for explained in check.explains.values():
            assert set(explained) <= known, (check.name, explained)


def test_the_records_vocabulary_holds_every_check_category_once_the_registry_is_imported():
    for name, category in registry.categories().items():
        assert records.CATEGORIES[name] == (category.severities, category.meaning), name


def test_findings_must_use_the_vocabulary():
    with pytest.raises(ValueError, match="not in CATEGORIES"):
        Finding("no_such_category", "error", [0], "message", "suggestion")
    with pytest.raises(ValueError, match="not in CATEGORIES"):
        Finding("uneven_batches", "warning", [0], "message", "suggestion")  # a check's category, another severity


def _docs_table() -> str:
    """The table of docs/doctor.md that starts with the registry's header, to the blank line after it."""
    lines = DOCS.read_text().splitlines()
    header = registry.docs_table().splitlines()[0]
    assert header in lines, f"docs/doctor.md has no table starting with {header!r}"
    start = lines.index(header)
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "\n".join(lines[start:end])


def test_the_docs_table_is_the_registry_s():
    assert _docs_table() == registry.docs_table(), (
        "docs/doctor.md's table of the script check's categories is not the registry's; regenerate it with\n"
        '  python -c "from gradsync.doctor.script.registry import docs_table; print(docs_table())"\n'
        "and paste it over the table in docs/doctor.md"
    )


# -- selecting checks ---------------------------------------------------------------------------


def test_an_unknown_check_name_is_the_users_mistake_naming_the_choices():
    with pytest.raises(ConfigError, match="--checks nope: no such check; choose among identical_batches, "):
        registry.selected_checks(["same_file", "nope"])
    with pytest.raises(ConfigError, match="--doctor-checks nope"):
        registry.parse_names("same_file,nope", option="--doctor-checks")
    with pytest.raises(ConfigError, match="name at least one check"):
        registry.parse_names(" , ")
    assert registry.parse_names("same_file, identical_batches") == ["identical_batches", "same_file"]  # CHECKS' order
    assert [check.name for check in registry.selected_checks(None)] == registry.check_names()


def _two_mistakes(**extra) -> dict[int, dict]:
    """Two ranks that drew the same batches and wrote the same checkpoint."""
    forwards = [{"fingerprint": 1, "site": "train.py:28", "loader": None}]
    writes = [{"path": "/ckpt/model.pt", "how": "torch.save", "step": 3, "site": "train.py:60"}]
    return {r: consistency_facts(forwards=forwards, writes=writes, **extra) for r in (0, 1)}


def test_the_checks_doctor_checks_selected_are_the_ones_whose_findings_count():
    assert _categories(registry.findings(_two_mistakes())) == ["no_distributed_sampler", "same_file_written"]
    # What --doctor-checks recorded in the ranks' facts ("checks"; None: every check).
    assert _categories(registry.findings(_two_mistakes(checks=["same_file"]))) == ["same_file_written"]
    assert _categories(registry.findings(_two_mistakes(checks=None))) == ["no_distributed_sampler", "same_file_written"]
    # Facts kept by another gradsync may name a check this one does not have: passed over.
    assert _categories(registry.findings(_two_mistakes(checks=["same_file", "retired"]))) == ["same_file_written"]
    # Names given to findings() win over the facts'.
    chosen = registry.findings(_two_mistakes(checks=["same_file"]), names=["identical_batches"])
    assert _categories(chosen) == ["no_distributed_sampler"]
    assert registry.findings({}) == []  # no facts (a run not under --doctor-steps): nothing to compare


# -- findings explained by another --------------------------------------------------------------


def _overlapping_shares() -> dict[int, dict]:
    """Two ranks whose samplers' seeds differ: their shares overlap (read by every check)."""
    checks = drawing(draw([0, 2, 4, 6]), draw([0, 2, 5, 7], seed=1, sampler_rank=1))
    for facts in checks.values():
        facts["loaders"] = [loader(4, key="train.py:30#0", site="train.py:30")]  # as long on every rank
    assert _categories(findings(checks)) == ["sampler_overlap"]
    return checks


def test_every_rank_drawing_the_same_batches_explains_the_overlap_of_their_shares():
    checks = _overlapping_shares()
    for facts in checks.values():
        facts["forwards"] = [{"fingerprint": 1, "site": "train.py:28", "loader": None}]
    assert _categories(registry.findings(checks, ["sampler_overlap"])) == ["sampler_overlap"]
    assert _categories(registry.findings(checks, ["identical_batches", "sampler_overlap"])) == ["no_distributed_sampler"]
    assert _categories(findings(checks)) == ["no_distributed_sampler"]


def test_a_split_that_differs_explains_the_overlap_of_the_shares():
    checks = _overlapping_shares()
    checks[0]["data_split"] = {"splits": [split([1, 2], [[0, 1, 2], [3]])]}
    checks[1]["data_split"] = {"splits": [split([3, 4], [[1, 2, 3], [0]])]}
    assert _categories(registry.findings(checks, ["sampler_overlap"])) == ["sampler_overlap"]
    # Whichever dataset the overlapping pass drew from (here the whole one, not a Subset of the split).
    assert _categories(findings(checks)) == ["data_split_differs"]


def test_an_update_that_differs_explains_the_replicas_divergence():
    clip = {"what": "clip_grad_norm_", "site": "train.py:38"}
    checks = {0: consistency_facts(steps_taken=[step_taken(1), step_taken(2, grads=5, calls=[clip])],
                                   models=[model({"w": 1})]),
              1: consistency_facts(steps_taken=[step_taken(1), step_taken(2)], models=[model({"w": 2})])}
    assert _categories(registry.findings(checks, ["replicas"])) == ["parameters_diverged"]
    assert _categories(findings(checks)) == ["update_differs"]
    # Without the consistency facts (an older gradsync's), the divergence is all there is to say.
    older = {rank: script_facts(models=facts["models"]) for rank, facts in checks.items()}
    assert _categories(findings(older)) == ["parameters_diverged"]
