"""eval_mode on hand-made facts: the rank in eval mode is named with the line that set it."""

from __future__ import annotations

from tests.doctor.script.facts import (
    consistency_categories,
    consistency_facts,
    consistency_found,
    rng_forward,
    step_taken,
)


def test_a_rank_training_in_eval_mode_is_named_with_the_line_that_set_it():
    trained = [rng_forward(1, 2), rng_forward(2, 3)]
    evaluated = [rng_forward(1, 2), rng_forward(2, 3, evals=["(the model)", "0", "1"], eval_site="train.py:50")]
    (finding,) = consistency_found({0: consistency_facts(forwards=evaluated), 1: consistency_facts(forwards=trained)})
    assert (finding.category, finding.ranks, finding.locations) == ("eval_mode_differs", [0], {"0": "train.py:50"})
    assert "From training forward 2 on" in finding.message
    frozen = [rng_forward(1, 2, evals=["backbone"], eval_site="train.py:12")]  # frozen on every rank: a choice
    assert consistency_categories({r: consistency_facts(forwards=frozen) for r in (0, 1)}) == []


def test_a_rank_that_switched_the_ddp_wrapper_to_eval_is_found_at_its_steps():
    # ddp.eval() on rank 0: its later forwards are not training forwards, but it keeps stepping.
    def stepping(modes):
        return [{**step_taken(s), "modes": [m]} for s, m in enumerate(modes, 1)]

    training = {"eval_modules": [], "eval_count": 0, "eval_site": None}
    wrapper = {"eval_modules": ["(the DDP wrapper)", "(the model)", "0"], "eval_count": 3, "eval_site": "train.py:51"}
    checks = {0: consistency_facts(steps_taken=stepping([training, wrapper, wrapper])),
              1: consistency_facts(steps_taken=stepping([training] * 3))}
    (finding,) = consistency_found(checks)
    assert (finding.category, finding.ranks, finding.locations) == ("eval_mode_differs", [0], {"0": "train.py:51"})
    assert finding.details["step"] == 2 and "From optimizer step 2 on" in finding.message
