"""fsdp_root on hand-made facts: a root unit holding most parameters, and a well-split model."""

from __future__ import annotations

from tests.doctor.script.facts import findings, script_facts


def test_an_fsdp_root_unit_holding_most_parameters_is_a_warning_and_well_split_models_are_not():
    def root(kept, largest):
        return {"site": "train.py:20", "class": "Transformer", "parameters": 1000, "in_root_unit": kept,
                "largest_in_root": largest}

    (finding,) = findings({r: script_facts(fsdp_roots=[root(800, ["tok_embeddings", 700])]) for r in (0, 1)})
    assert finding.category == "fsdp_root_holds_most" and finding.severity == "warning"
    assert "keeps 80% of its 1,000 parameters in its root unit (the largest part: 'tok_embeddings', 70%)" in finding.message
    assert findings({r: script_facts(fsdp_roots=[root(300, ["norm", 10])]) for r in (0, 1)}) == []
