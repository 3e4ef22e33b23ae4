"""parameter_order on hand-made facts: an order that differs is an error, said instead of the divergence it causes."""

from __future__ import annotations

from tests.doctor.script.facts import consistency_categories, consistency_facts, findings, model


def ordered(order) -> dict:
    return model({}, parameter_order=list(order), site="train.py:22")


def test_a_parameter_order_that_differs_is_an_error_and_replaces_the_divergence_it_causes():
    checks = {0: consistency_facts(models=[ordered(["a.weight", "b.weight"])]),
              1: consistency_facts(models=[ordered(["b.weight", "a.weight"])])}
    checks[0]["models"][0]["parameters"] = {"a.weight": 1, "b.weight": 2}
    checks[1]["models"][0]["parameters"] = {"a.weight": 2, "b.weight": 1}
    (finding,) = findings(checks)
    assert finding.category == "parameter_order_differs"
    assert finding.details == {"position": 0, "names": {"0": "a.weight", "1": "b.weight"}}
    assert consistency_categories({r: consistency_facts(models=[ordered(["a.weight", "b.weight"])]) for r in (0, 1)}) == []
