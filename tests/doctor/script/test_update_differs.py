"""update_differs on hand-made facts: blamed on the extra call (clipping, a scheduler step), or on the
rank whose parameters moved between two steps."""

from __future__ import annotations

from tests.doctor.script.facts import consistency_categories, consistency_facts, consistency_found, step_taken

CLIP = {"what": "clip_grad_norm_", "site": "train.py:38"}


def test_gradients_changed_on_one_rank_are_blamed_on_its_extra_call():
    checks = {0: consistency_facts(steps_taken=[step_taken(1), step_taken(2, grads=5, calls=[CLIP])]),
              1: consistency_facts(steps_taken=[step_taken(1), step_taken(2)])}
    (finding,) = consistency_found(checks)
    assert (finding.category, finding.ranks, finding.step) == ("update_differs", [0], 2)
    assert finding.locations == {"0": "train.py:38"} and "called clip_grad_norm_ at train.py:38" in finding.message
    # Clipping on every rank keeps the update the same everywhere.
    same = [step_taken(1, calls=[CLIP]), step_taken(2, calls=[CLIP])]
    assert consistency_categories({r: consistency_facts(steps_taken=same) for r in (0, 1)}) == []
    # A step after a backward under no_sync (local SGD, the micro-steps' own step): gradients differ by design.
    local = {0: consistency_facts(steps_taken=[step_taken(1, grads=1)], syncs_per_step=[0]),
             1: consistency_facts(steps_taken=[step_taken(1, grads=2)], syncs_per_step=[0])}
    assert consistency_categories(local) == []


def test_a_learning_rate_changed_on_one_rank_is_blamed_on_the_scheduler_call():
    sched = {"what": "scheduler.step", "site": "train.py:45"}
    rank0 = [step_taken(1), step_taken(2, calls=[sched]), step_taken(3, hyper="lr=0.05", calls=[sched])]
    rank1 = [step_taken(1), step_taken(2), step_taken(3)]
    (finding,) = consistency_found({0: consistency_facts(steps_taken=rank0), 1: consistency_facts(steps_taken=rank1)})
    assert (finding.ranks, finding.step, finding.locations) == ([0], 3, {"0": "train.py:45"})
    assert finding.details["differs"] == "hyperparameters"
    assert "(lr: rank 0 0.05, rank 1 0.1)" in finding.message, finding.message


def test_parameters_moved_between_steps_on_one_rank_are_blamed_on_it():
    rank0 = [step_taken(1, before=1, after=2), step_taken(2, before=2, after=3)]
    rank1 = [step_taken(1, before=1, after=2), step_taken(2, before=9, after=10)]
    (finding,) = consistency_found({0: consistency_facts(steps_taken=rank0), 1: consistency_facts(steps_taken=rank1)})
    assert (finding.ranks, finding.details["differs"]) == ([1], "parameters")
    assert "after optimizer step 1 (at train.py:40) and before step 2" in finding.message
    # Every rank changing them alike (weight clamping on every rank): the replicas stay equal.
    alike = [step_taken(1, before=1, after=2), step_taken(2, before=5, after=6)]
    assert consistency_categories({r: consistency_facts(steps_taken=alike) for r in (0, 1)}) == []


def test_under_pipeline_parallelism_each_stages_replicas_are_compared_among_themselves():
    # Ranks 0 and 2 hold stage 0, ranks 1 and 3 stage 1: the stages' gradients and parameters
    # differ by design, each stage's replicas' must not.
    replicas = {0: [0, 2], 2: [0, 2], 1: [1, 3], 3: [1, 3]}
    stage = {0: 1, 2: 1, 1: 7, 3: 7}

    def steps(rank, moved_at_2=False):
        value = stage[rank]
        return [step_taken(1, grads=value, before=value, after=value + 1, replicas=replicas[rank]),
                step_taken(2, grads=value, before=value + (5 if moved_at_2 else 1), after=value + 2, replicas=replicas[rank])]

    healthy = {rank: consistency_facts(steps_taken=steps(rank)) for rank in range(4)}
    assert consistency_categories(healthy) == []
    drifted = {**healthy, 2: consistency_facts(steps_taken=steps(2, moved_at_2=True))}
    (finding,) = consistency_found(drifted)
    assert (finding.ranks, finding.details["differs"]) == ([2], "parameters")
