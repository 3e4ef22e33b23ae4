"""The advice rules: each fires on a run whose numbers call for it, quotes the number, and stays
quiet on a healthy run; the list is ranked by what is at stake and never longer than five."""

from __future__ import annotations

from pathlib import Path

from gradsync.report.advice import MOST_SHOWN, advise, data_loading, exposed_communication, failed_run, rank_imbalance, skipped_steps
from gradsync.report.collect import RunRecords


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
