"""gradsync run's per-rank timeline: step times and waits from the workers' cumulative readings,
aligned across ranks by step, and the rank the others wait for. All on hand-built readings: the
timeline is a function of them, and what it decides (the slowest rank, communication against
imbalance, how many intervals) is judged where the timings are chosen."""

from __future__ import annotations

import pytest

from gradsync.report.timeline import FEWEST_INTERVALS, MOST_INTERVALS, step_at, timeline


def readings(seconds=12, steps_per_s=5, wait_share=0.0, clock=1000.0, counter="optimizer_steps", start_step=0):
    """One reading a second of a rank that steps at a steady pace and waits `wait_share` of the time."""
    return [{"time": clock + t, counter: start_step + steps_per_s * t, "backward_passes": steps_per_s * t,
             "communication_wait_s": wait_share * t} for t in range(seconds + 1)]


def test_a_rank_that_never_waits_is_the_one_the_others_wait_for():
    found = timeline({0: readings(wait_share=0.8), 1: readings(wait_share=0.0), 2: readings(wait_share=0.75)})
    assert found.unit == "optimizer step" and found.ranks == [0, 1, 2]
    assert set(found.slowest_rank()) == {1}
    assert all(share == pytest.approx(0.0) for share in found.communication_share())
    assert all(spread == pytest.approx(0.8) for spread in found.imbalance_share())
    assert all(t == pytest.approx(0.2) for t in found.step_time_s[0])  # 5 steps a second


def test_waiting_on_every_rank_alike_is_communication_not_imbalance():
    found = timeline({0: readings(wait_share=0.5), 1: readings(wait_share=0.5)})
    assert all(share == pytest.approx(0.5) for share in found.communication_share())
    assert all(spread == pytest.approx(0.0) for spread in found.imbalance_share())


def test_ranks_are_aligned_by_step_not_by_their_clocks():
    """Another host's clock is off by minutes and it started a second later: the same steps compare."""
    late = readings(seconds=13, wait_share=0.0, clock=1300.0, start_step=-5)
    found = timeline({0: readings(wait_share=0.6), 1: late})
    assert found.ends[0] > 0 and set(found.slowest_rank()) == {1}
    assert all(spread == pytest.approx(0.6) for spread in found.imbalance_share())


def test_a_pause_between_steps_makes_its_interval_long():
    """Evaluation for 6 s after step 30: the interval holding it is slower, the others are not."""
    rank = readings(seconds=6) + [{"time": 1000.0 + 6 + t, "optimizer_steps": 30 + 5 * max(0, t - 6),
                                   "communication_wait_s": 0.0} for t in range(1, 13)]
    found = timeline({0: rank})
    assert max(found.step_time_s[0]) > 3 * min(found.step_time_s[0])


def test_backward_passes_count_when_no_optimizer_was_seen_stepping():
    found = timeline({0: readings(counter="backward_passes"), 1: readings(counter="backward_passes")})
    assert found.unit == "backward pass"


@pytest.mark.parametrize("system", [
    {},
    {0: readings(steps_per_s=0)},  # never stepped (hung before its first step)
    {0: readings(seconds=FEWEST_INTERVALS - 1)},  # a run of two seconds is no timeline
    {0: [{"time": 1.0, "cpu_percent": 5.0}]},  # readings of a gradsync older than the counters
])
def test_no_timeline_without_enough_steps(system):
    assert timeline(system) is None


@pytest.mark.parametrize("seconds, intervals", [(FEWEST_INTERVALS - 1, None), (FEWEST_INTERVALS, FEWEST_INTERVALS)],
                         ids=["one_too_few", "just_enough"])
def test_a_timeline_needs_at_least_fewest_intervals(seconds, intervals):
    found = timeline({0: readings(seconds=seconds), 1: readings(seconds=seconds)})
    assert (found and len(found.ends)) == intervals


def test_intervals_are_no_finer_than_the_readings_or_the_steps_and_at_most_most_intervals():
    # A long run: one reading a second for twice MOST_INTERVALS seconds; MOST_INTERVALS intervals of 10 steps.
    long = timeline({0: readings(seconds=2 * MOST_INTERVALS)})
    assert len(long.ends) == MOST_INTERVALS and long.ends[:2] == [10, 20]
    # Fewer readings than that: one interval between each two.
    assert len(timeline({0: readings(seconds=MOST_INTERVALS - 10)}).ends) == MOST_INTERVALS - 10
    # Slow steps: 12 readings but 4 steps between the first and the last, so 4 intervals of one step.
    slow = [{"time": 1000.0 + t, "optimizer_steps": t // 3, "communication_wait_s": 0.0} for t in range(13)]
    assert timeline({0: slow}).ends == [1, 2, 3, 4]


def test_one_rank_waits_for_the_network_only_and_is_its_own_slowest():
    found = timeline({3: readings(wait_share=0.4)})
    assert set(found.slowest_rank()) == {3}
    assert all(share == pytest.approx(0.4) for share in found.communication_share())
    assert all(spread == pytest.approx(0.0) for spread in found.imbalance_share())


def test_ranks_that_wait_alike_name_the_lowest_rank_slowest():
    found = timeline({2: readings(wait_share=0.3), 1: readings(wait_share=0.3)})
    assert set(found.slowest_rank()) == {1}


def test_a_wait_share_stays_between_none_and_all_of_the_interval():
    """Readings of an older gradsync (waits summed as they ended) can outrun the clock, and a restarted
    worker's count starts again from zero: those shares are cut, not carried into the slowest rank or
    the imbalance. Readings taken now cannot outrun it (run.collectives.WaitClock)."""
    over = readings(wait_share=1.5)
    restarted = [{**row, "communication_wait_s": 100.0 - row["communication_wait_s"]} for row in readings(wait_share=0.2)]
    found = timeline({0: over, 1: restarted})
    assert set(found.wait_share[0]) == {1.0} and set(found.wait_share[1]) == {0.0}
    assert set(found.slowest_rank()) == {1} and all(spread == pytest.approx(1.0) for spread in found.imbalance_share())


def test_a_rank_with_a_single_reading_is_left_out():
    found = timeline({0: readings(), 1: readings()[:1]})
    assert found.ranks == [0]


def test_step_at_places_readings_on_the_step_axis():
    rows = [{"time": 1.0, "optimizer_steps": 4}, {"time": 2.0}]
    assert step_at(rows, "optimizer_steps") == [4.0, 0.0]
    assert step_at(rows, None) is None
