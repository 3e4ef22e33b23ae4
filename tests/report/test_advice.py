"""The advice rules: each fires on a run whose numbers call for it, quotes the number, and stays
quiet on a healthy run; the list is ranked by what is at stake and never longer than five.

Every rule is a function of the run's records, so each is judged on hand-built ones: both sides of
every threshold, and the runs with nothing to judge (no rows, zero step time, one rank)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradsync.profiling import analyze_trace
from gradsync.report.advice import (
    BUSY_SPREAD_SHARE, DATA_SHARE, EXPOSED_SHARE, HOTSPOT_SHARE, MOST_SHOWN, OTHER_SHARE, SKIPPED_SHARE, WARM_UP_STEPS,
    advice_lines, advise, data_loading, exposed_communication, failed_run, rank_imbalance, skipped_steps, time_elsewhere,
)
from gradsync.report.collect import RunRecords
from tests.profiling.traces import chrome_trace, gloo_step


def _rows(steps=20, step=0.1, exposed=0.01, skipped=None, busy_spread=None, slowest=0, busbw=None, ratio=None):
    rows = []
    for i in range(1, steps + 1):
        row = {"step": i, "step_time_s": step, "exposed_comm_s": exposed, "samples_per_s": 100.0, "skipped": None}
        if skipped and i % 2 == 0:
            row["skipped"] = skipped
        if busbw is not None:
            row["busbw_gbps"] = busbw
        if ratio is not None:
            row["compression_ratio"] = ratio
        if busy_spread is not None and i % 5 == 0:
            row.update(rank_busy_s={"0": step, "1": step - busy_spread}, busy_spread_s=busy_spread, interval_slowest_rank=slowest)
        rows.append(row)
    return rows


def _records(**parts) -> RunRecords:
    return RunRecords(Path("."), **parts)


def _breakdown(step_s, data_s):
    return {"mean": {"step_s": step_s, "data_s": data_s}}


HEALTHY = _records(rows=_rows(exposed=0.01, busy_spread=0.005), breakdowns={0: _breakdown(0.1, 0.005)},
                   diagnosis={"status": "ok", "findings": []})


def test_a_healthy_run_gets_no_advice():
    assert advise(HEALTHY) == []


def test_exposed_communication_above_30_percent_is_advised_with_its_share_and_the_link():
    advice = exposed_communication(_records(rows=_rows(exposed=0.045, busbw=0.29)))
    assert advice is not None and "exposed communication is 45% of the step" in advice.measured
    assert "0.29 GB/s" in advice.measured and "'compression': 'auto'" in advice.action
    assert "(all of it hidden, steps would be at most 1.8x faster)" in advice.measured, "the gain's bound: 1 / (1 - 45%)"
    # Already compressed: accumulate or check the network instead.
    compressed = exposed_communication(_records(rows=_rows(exposed=0.045, ratio=4.0)))
    assert "compressed already" in compressed.action
    assert exposed_communication(_records(rows=_rows(exposed=0.029))) is None  # 29%


def test_a_pipelines_waiting_is_advised_as_its_bubble_not_as_traffic_to_compress():
    rows = [{**row, "pipeline_bubble_share": 0.4} for row in _rows(exposed=0.045)]
    advice = exposed_communication(_records(rows=rows))
    assert "the pipeline's stages wait 40% of the step for each other (its bubble), of 45% spent waiting" in advice.measured
    assert "more micro-batches" in advice.action and "compression" not in advice.action


def test_ranks_busy_time_spread_names_the_usual_slowest_rank():
    advice = rank_imbalance(_records(rows=_rows(busy_spread=0.02, slowest=1)))
    assert advice is not None and advice.measured.startswith("rank 1 is usually the busiest") and "20%" in advice.measured
    assert rank_imbalance(_records(rows=_rows(busy_spread=0.01))) is None


def test_data_loading_share_of_the_profiled_step():
    advice = data_loading(_records(breakdowns={0: _breakdown(0.1, 0.01), 1: _breakdown(0.1, 0.04)}))
    assert advice is not None and "40% of the step on rank 1" in advice.measured and "num_workers" in advice.action
    assert data_loading(_records(breakdowns={0: _breakdown(0.1, 0.02)})) is None


def test_steps_skipped_for_overflow_or_nonfinite_gradients():
    assert "overflowed on 50%" in skipped_steps(_records(rows=_rows(steps=23, skipped="overflow"))).measured
    assert "bf16" in skipped_steps(_records(rows=_rows(steps=23, skipped="overflow"))).action
    assert "not finite on 50%" in skipped_steps(_records(rows=_rows(steps=23, skipped="nonfinite"))).measured
    assert skipped_steps(_records(rows=_rows())) is None


def test_a_failed_run_is_advised_first_with_the_diagnosis_suggestion():
    diagnosis = {"status": "failed", "findings": [{"severity": "error", "category": "collective_mismatch",
                                                   "locations": {"0": "train.py:9"}, "suggestion": "Every rank must ..."}]}
    records = _records(rows=_rows(exposed=0.05), diagnosis=diagnosis)
    first, second = advise(records)
    assert first.rule == "failed_run" and "collective_mismatch (rank 0: train.py:9)" in first.measured
    assert second.rule == "exposed_communication"
    assert failed_run(HEALTHY) is None


def test_advice_is_ranked_by_what_is_at_stake_and_capped():
    warnings = [{"severity": "warning", "category": "find_unused_parameters_unneeded", "message": "m. more", "suggestion": "s"}] * 6
    records = _records(rows=_rows(steps=23, exposed=0.045, busy_spread=0.03, skipped="overflow"),
                       breakdowns={0: _breakdown(0.1, 0.035)}, diagnosis={"status": "ok", "findings": warnings})
    advice = advise(records)
    assert len(advice) == MOST_SHOWN
    assert [a.rule for a in advice[:4]] == ["skipped_steps", "exposed_communication", "data_loading", "rank_imbalance"]
    assert advice[4].rule == "find_unused_parameters_unneeded" and advice[4].measured == "m"


def _recorded(waits):
    """gradsync run's readings of an unmodified script: one a second, rank -> share of time waiting."""
    return {rank: [{"time": 100.0 + t, "optimizer_steps": 4 * t, "communication_wait_s": share * t} for t in range(11)]
            for rank, share in waits.items()}


def test_an_unmodified_script_is_advised_from_gradsync_runs_timeline():
    # A straggler: rank 1 never waits; the others wait for it, not for the network.
    straggling = _records(system=_recorded({0: 0.7, 1: 0.0, 2: 0.65}), diagnosis={"status": "ok", "findings": [
        {"category": "straggler", "severity": "warning", "message": "The other ranks wait for rank 1. More.", "suggestion": "x"}]})
    found = advise(straggling)
    assert [a.rule for a in found] == ["rank_imbalance"], "the straggler warning says the same: not repeated"
    assert found[0].measured.startswith("rank 1 is the one the others wait for in 10 of 10 intervals") and "up to 70%" in found[0].measured
    # The network: even the rank that waits least waits 40% of the time.
    network = exposed_communication(_records(system=_recorded({0: 0.45, 1: 0.4})))
    assert network is not None and "40%" in network.measured and "no_sync" in network.action
    assert rank_imbalance(_records(system=_recorded({0: 0.45, 1: 0.4}))) is None
    # Healthy: little waiting anywhere.
    assert advise(_records(system=_recorded({0: 0.08, 1: 0.05}), diagnosis={"status": "ok", "findings": []})) == []


# Just below, at and just above each threshold: a rule speaks only above it.
AROUND = [(-0.01, False), (0.0, False), (0.01, True)]
AROUND_IDS = ["below", "at", "above"]
# gradsync run's readings are interpolated, which rounds: exactly at a threshold is judged on rows.
BELOW_AND_ABOVE = [(-0.01, False), (0.01, True)]


def _steady_rows(exposed_share=0.0, steps=1, **row):
    """The warm-up's rows and `steps` more: a step of 1 s, so a share is exactly the seconds it
    stands for (one steady row by default, so a threshold's own value is met exactly)."""
    return [{"step": i, "step_time_s": 1.0, "exposed_comm_s": exposed_share, "samples_per_s": 100.0, "skipped": None, **row}
            for i in range(1, WARM_UP_STEPS + steps + 1)]


@pytest.mark.parametrize("delta, fires", AROUND, ids=AROUND_IDS)
def test_exposed_communication_threshold_on_the_trainers_rows(delta, fires):
    advice = exposed_communication(_records(rows=_steady_rows(EXPOSED_SHARE + delta)))
    assert (advice is not None) == fires
    if fires:
        assert advice.at_stake == pytest.approx(EXPOSED_SHARE + delta)
        assert "0.00 GB/s" not in advice.measured and "bus bandwidth" not in advice.measured, "no link measured: none quoted"


@pytest.mark.parametrize("delta, fires", BELOW_AND_ABOVE, ids=["below", "above"])
def test_exposed_communication_threshold_on_gradsync_runs_timeline(delta, fires):
    # The rank that waits least waits EXPOSED_SHARE + delta of the time; the other 5 points more.
    share = EXPOSED_SHARE + delta
    advice = exposed_communication(_records(system=_recorded({0: share + 0.05, 1: share})))
    assert (advice is not None) == fires
    if fires:
        assert advice.at_stake == pytest.approx(share)


def test_the_warm_up_steps_are_left_out_unless_the_run_has_no_others():
    warm_up = [{"step": i, "step_time_s": 1.0, "exposed_comm_s": 0.9, "samples_per_s": 1.0, "skipped": "overflow"}
               for i in range(1, WARM_UP_STEPS + 1)]
    steady = _steady_rows(0.1, steps=10)[WARM_UP_STEPS:]
    assert exposed_communication(_records(rows=warm_up + steady)) is None
    assert skipped_steps(_records(rows=warm_up + steady)) is None
    # A run no longer than its warm-up is judged on what it has.
    assert exposed_communication(_records(rows=warm_up)).at_stake == pytest.approx(0.9)
    assert skipped_steps(_records(rows=warm_up)).at_stake == 1.0


def test_no_rows_or_no_step_time_is_no_exposed_communication():
    assert exposed_communication(_records()) is None
    assert exposed_communication(_records(rows=[{**row, "step_time_s": 0.0} for row in _steady_rows(0.5)])) is None


@pytest.mark.parametrize("delta, fires", AROUND, ids=AROUND_IDS)
def test_rank_imbalance_threshold_on_the_trainers_intervals(delta, fires):
    rows = _steady_rows()
    rows[-1].update(rank_busy_s={"0": 1.0, "1": 1.0 - BUSY_SPREAD_SHARE - delta}, busy_spread_s=BUSY_SPREAD_SHARE + delta,
                    interval_slowest_rank=0)
    advice = rank_imbalance(_records(rows=rows))
    assert (advice is not None) == fires
    if fires:
        assert advice.at_stake == pytest.approx(BUSY_SPREAD_SHARE + delta) and advice.measured.startswith("rank 0 ")


@pytest.mark.parametrize("delta, fires", BELOW_AND_ABOVE, ids=["below", "above"])
def test_rank_imbalance_threshold_on_gradsync_runs_timeline(delta, fires):
    spread = BUSY_SPREAD_SHARE + delta
    advice = rank_imbalance(_records(system=_recorded({0: 0.05 + spread, 1: 0.05})))
    assert (advice is not None) == fires
    if fires:
        assert advice.at_stake == pytest.approx(spread) and advice.measured.startswith("rank 1 is the one the others wait for")


def test_rank_imbalance_needs_two_ranks_intervals_and_a_step_time():
    # One rank recorded: nobody to wait for, however long it waited.
    assert rank_imbalance(_records(system=_recorded({0: 0.9}))) is None
    # Rows without an interval summary (a single-process run's gathers carry none with a spread).
    assert rank_imbalance(_records(rows=_steady_rows())) is None
    none_spread = _steady_rows()
    none_spread[-1].update(rank_busy_s={"0": 1.0}, busy_spread_s=None)
    assert rank_imbalance(_records(rows=none_spread)) is None
    # Zero step time: no share to speak of.
    zero = [{**row, "step_time_s": 0.0} for row in _steady_rows()]
    zero[-1].update(rank_busy_s={"0": 0.5, "1": 0.0}, busy_spread_s=0.5, interval_slowest_rank=0)
    assert rank_imbalance(_records(rows=zero)) is None


@pytest.mark.parametrize("delta, fires", AROUND, ids=AROUND_IDS)
def test_data_loading_threshold(delta, fires):
    advice = data_loading(_records(breakdowns={0: _breakdown(1.0, DATA_SHARE + delta)}))
    assert (advice is not None) == fires


def test_data_loading_needs_a_step_time_and_a_data_part():
    assert data_loading(_records()) is None
    assert data_loading(_records(breakdowns={0: _breakdown(0.0, 0.5)})) is None
    assert data_loading(_records(breakdowns={0: {"mean": {"step_s": 1.0}}})) is None
    # A rank without the numbers does not hide another rank's.
    advice = data_loading(_records(breakdowns={0: _breakdown(0.0, 0.5), 1: _breakdown(1.0, 0.5)}))
    assert advice is not None and "rank 1" in advice.measured


def test_data_loading_from_a_breakdown_of_a_trace():
    """From a trace to the advice: the breakdown's data share is what the rule judges."""
    def breakdown(data_end):
        step = gloo_step(data=(0, data_end), forward=(data_end, data_end + 100), backward=(data_end + 100, data_end + 400),
                         autograd=((data_end + 110, data_end + 300),), calls=(), gloo=(),
                         optimizer=(data_end + 400, data_end + 460), end=data_end + 500)
        return analyze_trace(chrome_trace(step)).to_dict()

    assert data_loading(_records(breakdowns={0: breakdown(600)})).measured.startswith("data loading takes 55% of the step")
    assert data_loading(_records(breakdowns={0: breakdown(100)})) is None  # 100 of 600 µs: 17%


def _skipped_rows(reason, skipped, steady):
    rows = _steady_rows(steps=steady)
    for row in rows[WARM_UP_STEPS:WARM_UP_STEPS + skipped]:
        row["skipped"] = reason
    return rows


@pytest.mark.parametrize("reason", ["overflow", "nonfinite"])
@pytest.mark.parametrize("skipped, steady, fires", [(1, 11, False), (2, 20, False), (2, 19, True)],
                         ids=["below", "at", "above"])
def test_skipped_steps_threshold(reason, skipped, steady, fires):
    assert (skipped / steady > SKIPPED_SHARE) == fires
    assert (skipped_steps(_records(rows=_skipped_rows(reason, skipped, steady))) is not None) == fires


def test_overflow_is_advised_before_nonfinite_gradients_and_no_rows_is_nothing():
    rows = _skipped_rows("overflow", 5, 20)
    for row in rows[-5:]:
        row["skipped"] = "nonfinite"
    assert "overflowed on 25%" in skipped_steps(_records(rows=rows)).measured
    assert skipped_steps(_records()) is None


def test_the_straggler_warning_is_advised_when_no_measured_rule_says_it():
    straggler = {"category": "straggler", "severity": "warning", "message": "The other ranks wait for rank 1. More.",
                 "suggestion": "look at rank 1"}
    balanced = _records(system=_recorded({0: 0.06, 1: 0.05}), diagnosis={"status": "ok", "findings": [straggler]})
    assert [(a.rule, a.measured) for a in advise(balanced)] == [("straggler", "The other ranks wait for rank 1")]


def test_advice_lines_name_the_report_and_are_left_out_for_a_failed_or_unreadable_run(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(row) for row in _steady_rows(0.45)))
    (line,) = advice_lines(tmp_path)
    assert line.startswith("advice: exposed communication is 45% of the step") and f"`gradsync report {tmp_path}`" in line
    (tmp_path / "diagnosis.json").write_text(json.dumps({"status": "failed", "findings": []}))
    assert advice_lines(tmp_path) == [], "a failed run's diagnosis is what to do"
    assert advice_lines(tmp_path / "missing") == []


# Time outside every phase, and the lines it goes to (the profile's sampled stacks).


def _profiled(step_s, other_s, *spots, data_s=0.0):
    """A breakdown with its hotspots: (where, kind, share) each."""
    return {"mean": {"step_s": step_s, "other_s": other_s, "data_s": data_s},
            "hotspots": [{"where": where, "function": "main", "kind": kind, "share": share} for where, kind, share in spots]}


SLEEPY = _profiled(0.06, 0.054, ("train.py:40", "framework", 0.08), ("train.py:52", "own", 0.88), ("train.py:60", "own", 0.02))


def test_a_sleep_heavy_loop_is_advised_with_the_line_its_step_goes_to():
    advice = time_elsewhere(_records(breakdowns={0: SLEEPY}))
    assert advice is not None and advice.rank == 0 and advice.at_stake == pytest.approx(0.9)
    assert advice.measured.startswith("90% of the step on rank 0 is none of data loading, forward, backward")
    # The user's own line, not the line that called torch's work, nor one under the share named.
    assert "most at train.py:52 in main (88%)" in advice.measured
    assert "train.py:40" not in advice.measured and "train.py:60" not in advice.measured
    assert "every N steps" in advice.action


def test_a_compute_bound_loop_gets_no_advice_about_time_elsewhere():
    compute_bound = _profiled(0.06, 0.002, ("train.py:40", "framework", 0.95), ("train.py:52", "own", 0.03))
    assert time_elsewhere(_records(breakdowns={0: compute_bound})) is None
    assert advise(_records(breakdowns={0: compute_bound})) == []


@pytest.mark.parametrize("delta, fires", AROUND, ids=AROUND_IDS)
def test_time_elsewhere_threshold(delta, fires):
    advice = time_elsewhere(_records(breakdowns={0: _profiled(1.0, OTHER_SHARE + delta)}))
    assert (advice is not None) == fires


def test_time_elsewhere_without_sampled_lines_says_how_to_get_them_and_lines_under_the_share_are_not_named():
    advice = time_elsewhere(_records(breakdowns={1: _profiled(1.0, 0.5, ("a.py:1", "own", HOTSPOT_SHARE - 0.001))}))
    assert "rank 1" in advice.measured and "--profile-steps" in advice.measured and "a.py:1" not in advice.measured
    assert "a.py:1" in time_elsewhere(_records(breakdowns={1: _profiled(1.0, 0.5, ("a.py:1", "own", HOTSPOT_SHARE))})).measured


def test_slow_data_loading_names_the_data_lines():
    slow_collate = _profiled(1.0, 0.0, ("data.py:12", "data", 0.4), ("train.py:52", "own", 0.3), data_s=0.45)
    advice = data_loading(_records(breakdowns={0: slow_collate}))
    assert "data loading takes 45% of the step on rank 0 (profiled steps), most at data.py:12 in main (40%)" in advice.measured
    assert "train.py:52" not in advice.measured


def test_the_rank_the_others_wait_for_gets_one_advice_that_names_where_its_step_goes():
    records = _records(rows=_rows(busy_spread=0.05, slowest=1), breakdowns={0: _profiled(0.06, 0.001), 1: SLEEPY})
    (advice,) = advise(records)
    assert advice.rule == "rank_imbalance" and advice.measured.startswith("rank 1 is usually the busiest")
    assert advice.measured.endswith("; its steps go most to train.py:52 in main (88%)")
    # Every rank sleeping alike is no imbalance: the time-elsewhere advice stands on its own.
    (alike,) = advise(_records(rows=_rows(busy_spread=0.001), breakdowns={0: SLEEPY, 1: SLEEPY}))
    assert alike.rule == "time_elsewhere"
