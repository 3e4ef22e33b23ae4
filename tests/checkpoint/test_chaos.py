"""`make chaos` shortened: a few of its trials, each ending bitwise equal to an uninterrupted run,
detected within the stall timeout + 10 s; and its planning and reporting without processes.

The full benchmark (benchmarks/chaos.py, 33 trials) runs outside `make test`; these trials are
the kinds no other test covers: SIGKILL during a checkpoint write, and a simulated
host whose link goes down for longer than the stall timeout (that one needs root). Damaged
checkpoints are test_resume's, a full disk test_disk_full's, a frozen rank test_faults'.
"""

from __future__ import annotations

import random

import pytest

from benchmarks.chaos import (
    EVERY, KINDS, STALL_TIMEOUT_S, TRIAL_TIMEOUT_S, Outcome, Trial, damage, plan, reference, root_problem, run_trial, table,
)

# One reference (both trials run on two ranks, so they share it) and two trials, each its own hang
# guard (TRIAL_TIMEOUT_S, then 10 s to read its output): the test's guard is what they add up to.
# Three and four ranks are `make chaos`'s.
LAUNCHES = 3


@pytest.mark.launches
@pytest.mark.timeout(LAUNCHES * (TRIAL_TIMEOUT_S + 10))
def test_a_few_chaos_trials_end_bitwise_equal_and_are_detected_in_time(tmp_path):
    trials = [
        Trial("sigkill-sync-save", seed=1, world_size=2, step=2 * EVERY, rank=1),  # resumes from the save before
    ]
    if root_problem("host-cut") is None:
        trials.append(Trial("host-cut", seed=3, world_size=2, step=EVERY + 2, rank=1, hosts=2))
    references = {}
    for index, trial in enumerate(trials):
        if trial.world_size not in references:
            references[trial.world_size] = reference(trial.world_size, tmp_path / f"reference-{trial.world_size}")
        outcome = run_trial(trial, tmp_path / f"trial-{index}", references[trial.world_size])
        assert outcome.finished and outcome.bitwise, outcome
        assert outcome.detect_s is not None and outcome.detect_s <= STALL_TIMEOUT_S + 10, outcome
        assert outcome.resume_s is not None and outcome.steps_lost is not None, outcome
        assert 0 <= outcome.steps_lost <= EVERY, outcome


def test_the_plan_strikes_after_a_checkpoint_and_before_the_end_at_every_kind():
    steps = {2: 36, 3: 24, 4: 18}
    trials = plan(list(KINDS), 3, seed=0, total_steps=steps.__getitem__)
    assert len(trials) == 3 * len(KINDS)
    for trial in trials:
        assert EVERY < trial.step <= steps[trial.world_size] - 2, trial
        assert 0 <= trial.rank < trial.world_size
        if trial.kind.endswith("-save") or trial.kind.startswith("disk-full"):
            assert trial.step % EVERY == 0, trial  # a step that saves
        if trial.kind.startswith("corrupt"):
            assert trial.step > 2 * EVERY, trial  # one checkpoint to damage, one to resume from
    assert {t.world_size for t in trials if t.kind == "sigkill"} == {2, 3, 4}
    assert plan(["sigkill"], 3, 0, steps.__getitem__) == plan(["sigkill"], 3, 0, steps.__getitem__)  # seeded


def test_damage_breaks_a_checkpoint_three_ways(tmp_path):
    folder = tmp_path / "step-000000008"
    folder.mkdir()
    (folder / "manifest.json").write_text("{}")
    data = folder / "__0_0.distcp"
    data.write_bytes(bytes(range(256)) * 4)
    damage(folder, "flipped", random.Random(0))
    assert data.stat().st_size == 1024 and data.read_bytes() != bytes(range(256)) * 4
    damage(folder, "truncated", random.Random(0))
    assert data.stat().st_size == 512
    damage(folder, "no-manifest", random.Random(0))
    assert not (folder / "manifest.json").exists()


def test_the_table_counts_each_kind_and_the_total():
    trial = Trial("sigkill", seed=0, world_size=3, step=9, rank=1)
    outcomes = [Outcome(trial, finished=True, bitwise=True, steps_lost=1, detect_s=0.2, resume_s=3.0),
                Outcome(trial, finished=True, bitwise=False, steps_lost=3, detect_s=0.4, resume_s=5.0)]
    rows = table(outcomes).splitlines()
    assert rows[2] == "| sigkill (3 ranks) | 2 | 2 | 1 | 2 / 3 | 0.3 / 0.4 s | 4.0 / 5.0 s |"
    assert rows[3] == "| **all** | 2 | 2 | 1 | | | |"
