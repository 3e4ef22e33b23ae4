"""compression='auto': the decision on injected measurements (no process group, no timing), the
bucket size and a trial's cost as pure functions, and the tuner agreeing across real Gloo ranks.

Thresholds are tested on both sides with timings exact in binary (1.0 s steps, a margin of
0.125), so "at the threshold" means exactly at it.
"""

import json

import pytest
import torch
import torch.distributed as dist

from gradsync.comm import CompressionConfig
from gradsync.comm.auto import (
    TIE,
    AutoDecision,
    AutoMeasurements,
    PERIODIC_MOST,
    AutoTuner,
    CandidateTiming,
    auto_bucket_cap_mb,
    bucket_cap_mb_for,
    choose_accumulation,
    decide,
    typical_step_s,
)
from gradsync.ddp import DDPConfig
from gradsync.errors import ConfigError
from tests.harness import launch

MARGIN = 0.125


def measured(steps, exposed=0.5, noise=0.0, margin=MARGIN, accumulation=1, most=None):
    """Measurements with these step times (fp32 first); `exposed` and `noise`: one for all, or per name."""
    exposed = exposed if isinstance(exposed, dict) else dict.fromkeys(steps, exposed)
    noise = noise if isinstance(noise, dict) else dict.fromkeys(steps, noise)
    return AutoMeasurements(
        candidates=tuple(CandidateTiming(name, step, exposed[name], noise[name]) for name, step in steps.items()),
        margin=margin, accumulation_steps=accumulation, max_accumulation_steps=most or accumulation,
    )


def chosen(steps, **kwargs):
    return decide(measured(steps, **kwargs)).compression


# The compressor: the margin and the trials' noise against fp32's step; fp32's exposed share explains.


def test_the_step_times_decide_and_fp32s_exposed_share_only_explains_the_choice():
    # int8 is 50% faster although only 12.4% of fp32's step visibly waited: on a CPU, Gloo's
    # threads compete with backward, so the wait understates the cost. The step times win.
    steps = {"none": 1.0, "int8": 0.5}
    below = decide(measured(steps, exposed={"none": 0.124, "int8": 0.0}))
    assert below.compression == "int8"
    assert below.reason == (
        "auto compression chose int8: int8 cut the step time by 50%, beyond the trials' noise, although fp32 left "
        "124.0 ms (12%) of each step waiting for communication: the step times win (Gloo's threads compete with "
        "backward for the cores, so the share that waited understates what communication costs; compressors "
        "within 2% of the fastest count as tied and the least lossy of them wins). "
        "Step times (median of each trial): none 1000.0 ms, int8 500.0 ms."
    )
    # The trial issue 43 quotes (300 Mbit/s): 9% of fp32's step exposed, and "chose none". bf16 and
    # PowerSGD both cut it by 26-27%, within 2% of each other: a tie, which the less lossy wins.
    issue = decide(measured({"none": 1.7479, "bf16": 1.2899, "powersgd": 1.2782}, exposed=0.1503, noise=0.02, margin=0.10))
    assert issue.compression == "bf16"
    # Much exposed, yet no compressor faster: the step times win that way too, and the log says so.
    held = decide(measured({"none": 1.0, "bf16": 0.95}, exposed=0.6))
    assert held.compression == "none"
    assert held.reason.startswith(
        "auto compression chose none: no compressor was more than 12% faster than fp32, although fp32 left 600.0 ms "
        "(60%) of each step waiting for communication: the step times win (a compressor's own cost on the cores "
        "took what it saved on the wire), so gradients stay exact. Step times"
    )
    # Little exposed and nothing faster: the network keeps up.
    assert decide(measured({"none": 1.0, "bf16": 0.99}, exposed=0.05)).reason.startswith(
        "auto compression chose none: no compressor was more than 12% faster than fp32 (fp32 left 50.0 ms (5%) of "
        "each step waiting for communication: the network keeps up with the compute), so gradients stay exact."
    )


def test_a_compressor_must_beat_fp32_by_more_than_the_margin_and_the_trials_noise():
    assert chosen({"none": 1.0, "int8": 0.8749}) == "int8"
    assert chosen({"none": 1.0, "int8": 0.875}) == "none"  # exactly 12.5% faster is not more than 12.5%
    assert chosen({"none": 1.0, "int8": 0.8751}) == "none"
    # A trial slower than fp32 never wins, however exposed fp32 was.
    assert chosen({"none": 1.0, "bf16": 1.2}, exposed=0.9) == "none"
    # The default margin: 3-4% faster is not enough, 40% is.
    assert chosen({"none": 0.100, "bf16": 0.097, "int8": 0.096}, exposed=0.05, margin=0.05) == "none"
    assert chosen({"none": 0.100, "bf16": 0.090, "int8": 0.060}, exposed=0.05, margin=0.05) == "int8"
    # 20% faster, beyond the margin: chosen while the trials' noise is under it (2 * sqrt(2) * 7% = 19.8%) ...
    assert chosen({"none": 1.0, "int8": 0.8}, noise=0.07) == "int8"
    # ... kept out once it could be chance (2 * sqrt(2) * 7.1% = 20.1%), and the log says why.
    noisy = decide(measured({"none": 1.0, "int8": 0.8}, noise=0.071))
    assert noisy.compression == "none"
    assert noisy.reason.startswith("auto compression chose none: no compressor was more than 12% faster than fp32 "
                                   "beyond the trials' noise, although fp32 left 500.0 ms (50%)")
    # One noisy trial is enough: fp32's own.
    assert chosen({"none": 1.0, "int8": 0.8}, noise={"none": 0.1, "int8": 0.0}) == "none"


def test_the_same_measurements_up_to_noise_give_the_same_choice():
    # Rounds of one bench: step times that move within their noise, one candidate faster beyond it.
    rounds = [{"none": 1.75, "bf16": 1.29, "powersgd": 1.05}, {"none": 1.70, "bf16": 1.33, "powersgd": 1.08},
              {"none": 1.80, "bf16": 1.27, "powersgd": 1.02}, {"none": 1.72, "bf16": 1.31, "powersgd": 1.06}]
    exposure = [0.15, 0.40, 0.10, 0.30]  # what waited moves a lot more: it no longer decides
    assert {chosen(steps, exposed=e, noise=0.02, margin=0.10) for steps, e in zip(rounds, exposure)} == {"powersgd"}


def test_between_compressors_the_fastest_wins_unless_a_less_lossy_one_is_within_the_tie():
    assert TIE == 0.02
    steps = {"none": 1.0, "bf16": 0.8, "powersgd": 0.51, "int8": 0.5}
    tied = decide(measured(steps))  # powersgd exactly 2% slower than int8: a tie, the less lossy wins
    assert tied.compression == "powersgd"
    assert ("fp32 left 500.0 ms (50%) of each step waiting for communication; powersgd cut the step time by 49%, "
            "beyond the trials' noise (communication was the bottleneck; compressors within 2% of the fastest count as tied and the least "
            "lossy of them wins). Step times (median of each trial): none 1000.0 ms, bf16 800.0 ms, "
            "powersgd 510.0 ms, int8 500.0 ms.") in tied.reason
    assert chosen({**steps, "powersgd": 0.5099}) == "powersgd"
    assert chosen({**steps, "powersgd": 0.5101}) == "int8"  # just beyond the tie: the faster wins
    assert chosen({**steps, "powersgd": 0.5, "bf16": 0.5}) == "bf16"  # equally fast: the least lossy
    # Only compressors that beat fp32 by the margin compete: bf16 within 2% of a loser does not win.
    assert chosen({"none": 1.0, "bf16": 0.88, "int8": 0.87}) == "int8"


def test_the_reason_says_when_the_runner_up_was_within_the_trials_noise():
    # int8 beats powersgd by 10%, beyond the tie: int8 wins either way. The log says the call
    # was close when 10% is under twice the two trials' spreads combined.
    steps = {"none": 1.0, "powersgd": 0.55, "int8": 0.5}
    close = decide(measured(steps, noise=0.0355))  # 2 * sqrt(2) * 3.55% = 10.04%
    assert close.compression == "int8"
    assert close.reason.endswith(
        ". powersgd was within the trials' noise of it (+10.0%): a close call between two compressors that keep "
        "accuracy alike. Step times (median of each trial): none 1000.0 ms, powersgd 550.0 ms, int8 500.0 ms."
    )
    clear = decide(measured(steps, noise=0.0353))  # 9.98%
    assert clear.compression == "int8" and "within the trials' noise" not in clear.reason
    # The noisier trial counts with its own spread: one noisy trial is enough.
    assert "within the trials' noise" in decide(measured(steps, noise={"none": 0.0, "powersgd": 0.0, "int8": 0.051})).reason
    # A runner-up slower than fp32's bar is no runner-up, however noisy.
    assert "within the trials' noise" not in decide(measured({"none": 1.0, "powersgd": 0.9, "int8": 0.5}, noise=0.1)).reason


# Accumulation, after the compressor.


def test_accumulation_stays_and_nothing_is_said_about_it_unless_the_user_allows_it():
    decision = decide(measured({"none": 1.0, "bf16": 0.5}, exposed=0.45, accumulation=2))
    assert decision.compression == "bf16" and decision.accumulation_steps == 2
    assert decision.accumulation_reason is None
    # The prediction is the measured step itself.
    assert (decision.predicted_step_s, decision.predicted_exposed_share) == (0.5, 0.9)


def test_allowed_accumulation_is_raised_only_from_the_margin_on():
    steps = {"none": 1.0, "bf16": 0.5}
    under = decide(measured(steps, exposed={"none": 0.5, "bf16": 0.0624}, most=8))
    assert under.accumulation_steps == 1
    assert under.accumulation_reason == (
        "auto kept accumulation as it is (1 per step): with bf16, 12% of each step still waited for communication, "
        "under the 12% worth growing the global batch for."
    )
    at = decide(measured(steps, exposed={"none": 0.5, "bf16": 0.0625}, most=8))  # exactly 12.5% exposed
    # 2 micro-batches: 0.4375 s of compute each, one wait of 0.0625: 6.7% exposed.
    assert (at.accumulation_steps, at.predicted_step_s, at.predicted_exposed_share) == (2, 0.9375, 0.0625 / 0.9375)
    assert at.accumulation_reason == (
        "auto raises accumulation from 1 to 2 micro-batches per step (allowed up to 8): with bf16, 12% of each step "
        "still waited for communication; one all-reduce per 2 micro-batches should leave 7% exposed and take 6% less "
        "time per sample."
    )


def test_raised_accumulation_is_the_smallest_multiple_of_the_users_that_hides_the_wait_up_to_the_maximum():
    steps = {"none": 0.100, "bf16": 0.070}
    # bf16 still leaves 30 of 70 ms exposed: 6 micro-batches leave 11%, 7 leave 9.7%.
    raised = decide(measured(steps, exposed={"none": 0.06, "bf16": 0.03}, margin=0.10, most=8))
    assert (raised.compression, raised.accumulation_steps) == ("bf16", 7)
    assert raised.predicted_step_s == pytest.approx(7 * 0.040 + 0.030)
    # Capped: 4 micro-batches still leave 16%, and 4 is all the user allowed.
    capped = decide(measured(steps, exposed={"none": 0.06, "bf16": 0.03}, margin=0.10, most=4))
    assert capped.accumulation_steps == 4 and capped.predicted_exposed_share == pytest.approx(0.03 / 0.19)
    assert "from 1 to 4 micro-batches per step (allowed up to 4)" in capped.accumulation_reason
    # The user's 2 micro-batches took 200 ms with bf16, 60 of them exposed: 4 leave 18%, 6 12.5%,
    # 8 9.7%. Only multiples of 2, the smallest that hides the wait, and never above the maximum.
    users = {"none": 0.300, "bf16": 0.200}, {"none": 0.1, "bf16": 0.06}
    assert decide(measured(users[0], exposed=users[1], margin=0.10, accumulation=2, most=10)).accumulation_steps == 8
    capped = decide(measured(users[0], exposed=users[1], margin=0.10, accumulation=2, most=7))
    assert capped.accumulation_steps == 6
    assert "from 2 to 6 micro-batches per step (allowed up to 7)" in capped.accumulation_reason


def test_choose_accumulation_predicts_one_wait_per_k_micro_batches():
    # 45 ms of a 100 ms step exposed: 2 micro-batches leave 29%, 4 leave 17%, 8 leave 9.3%.
    assert choose_accumulation(0.100, 0.045, 1, 8, 0.10) == (8, pytest.approx(8 * 0.055 + 0.045), pytest.approx(0.045 / (8 * 0.055 + 0.045)))
    assert choose_accumulation(0.100, 0.045, 1, 4, 0.10)[::2] == (4, pytest.approx(0.045 / (4 * 0.055 + 0.045)))
    assert choose_accumulation(0.100, 0.045, 1, 1, 0.10) == (1, 0.100, pytest.approx(0.45))  # not allowed
    assert choose_accumulation(0.100, 0.008, 1, 8, 0.10)[::2] == (1, pytest.approx(0.08))  # under the margin
    assert choose_accumulation(0.100, 0.020, 1, 8, 0.10)[0] == 3  # 2 would leave 11%
    # The user's 2 micro-batches took 200 ms, 60 of them exposed: 4 leave 18%, 6 12.5%, 8 9.7%.
    assert choose_accumulation(0.200, 0.060, 2, 8, 0.10)[::2] == (8, pytest.approx(0.06 / (4 * 0.14 + 0.06)))
    assert choose_accumulation(0.200, 0.060, 2, 7, 0.10)[0] == 6  # multiples of 2 only, up to the cap
    # Far from the margin: the first multiple under it, found among a million without walking them.
    # (Exact in binary: 1/1024 s of compute; 7161 micro-batches leave exactly 12.5%, 7162 just under.)
    assert choose_accumulation(1.0, 1 - 2**-10, 1, PERIODIC_MOST, 0.125)[0] == 7162
    # No compute to spread the wait over, or a margin of 0: no k gets under it, so the largest allowed.
    assert choose_accumulation(1.0, 1.0, 1, PERIODIC_MOST, 0.10)[0] == PERIODIC_MOST
    assert choose_accumulation(0.100, 0.045, 2, 9, 0.0)[0] == 8


def test_a_trial_waits_its_median_share_of_its_own_steps():
    from gradsync.comm.auto import Trial

    # Slow first steps (a warming-up run) beside fast later ones: each wait is a share of its own step.
    trial = Trial("none", None, step_times=[0.40, 0.45, 0.03, 0.028, 0.025], exposed_times=[0.36, 0.40, 0.006, 0.007, 0.005])
    assert trial.exposed_share() == pytest.approx(0.25)
    assert trial.exposed_share() * typical_step_s(trial.step_times) <= typical_step_s(trial.step_times)
    assert Trial("none", None, step_times=[0.0, 0.1], exposed_times=[0.0, 0.0]).exposed_share() == 0.0


# The proposed period.


def test_a_period_is_proposed_only_while_the_chosen_compressor_leaves_the_margin_exposed():
    steps = {"none": 0.100, "bf16": 0.070}
    # fp32 computes 40 ms and waits 60; one agreement (about fp32's 60 ms) per 14 steps leaves 9.7%, per 13 10.3%.
    waiting = decide(measured(steps, exposed={"none": 0.06, "bf16": 0.03}, margin=0.10))
    assert (waiting.compression, waiting.proposed_periodic_every) == ("bf16", 14)
    assert waiting.periodic_reason == (
        "with bf16, 43% of each step still waits for communication. Synchronising every 14 steps instead "
        "(ddp={'periodic': {'every': 14}}, local SGD; compression 'none') should leave about 10%; it changes the "
        "optimisation, so auto does not apply it: measure its accuracy first (docs/performance.md)."
    )
    hidden = decide(measured(steps, exposed={"none": 0.06, "bf16": 0.005}, margin=0.10))
    assert (hidden.compression, hidden.proposed_periodic_every, hidden.periodic_reason) == ("bf16", None, None)
    # Both sides of the margin, exactly: bf16 leaves 12.5% of its 0.5 s step, then a hair less.
    at = decide(measured({"none": 1.0, "bf16": 0.5}, exposed={"none": 0.5, "bf16": 0.0625}))
    assert at.proposed_periodic_every == 8  # fp32: 0.5 s compute, 0.5 s wait; 8 steps: 0.5 / 4.5 = 11%
    assert decide(measured({"none": 1.0, "bf16": 0.5}, exposed={"none": 0.5, "bf16": 0.0624})).proposed_periodic_every is None
    # fp32 kept because it left little exposed proposes nothing either.
    assert decide(measured({"none": 1.0, "bf16": 0.5}, exposed=0.01)).proposed_periodic_every is None


def test_the_log_lines_are_the_reasons_in_order():
    decision = decide(measured({"none": 0.100, "bf16": 0.070}, exposed={"none": 0.06, "bf16": 0.03}, margin=0.10, most=8))
    assert decision.messages() == [decision.reason, decision.accumulation_reason, decision.periodic_reason]
    kept = decide(measured({"none": 1.0, "bf16": 0.5}, exposed=0.01))  # nothing to say about accumulation or a period
    assert kept.messages() == [kept.reason]


# Degenerate timings decide something and raise nothing (auto runs inside users' programs).


def test_zero_step_times_keep_fp32():
    zero = decide(measured({"none": 0.0, "bf16": 0.0, "int8": 0.0}, exposed=0.0, most=4))
    assert (zero.compression, zero.accumulation_steps, zero.proposed_periodic_every) == ("none", 1, None)
    assert "fp32 left 0.0 ms (0%) of each step" in zero.reason
    # Even with a margin of 0, which makes any exposed share "worth" hiding.
    assert decide(measured({"none": 0.0, "int8": 0.0}, exposed=0.0, margin=0.0, most=4)).compression == "none"


def test_a_compressor_measured_at_zero_wins_without_a_ratio_to_its_runner_up():
    decision = decide(measured({"none": 1.0, "powersgd": 0.0, "int8": 0.0}, exposed={"none": 0.5, "powersgd": 0.0, "int8": 0.0},
                               noise=0.3, most=4))
    assert decision.compression == "powersgd"  # tied at zero: the less lossy
    assert "cut the step time by 100%" in decision.reason and "within the trials' noise" not in decision.reason
    assert (decision.accumulation_steps, decision.proposed_periodic_every) == (1, None)


def test_exposed_time_above_the_step_time_raises_accumulation_to_the_maximum_without_dividing_by_zero():
    # The least-waiting rank's median wait against the slowest rank's lower-quartile step can
    # cross: nothing is left to compute, so no k hides the wait, and auto takes what it may.
    assert choose_accumulation(0.100, 0.150, 1, 8, 0.10) == (8, 0.100, pytest.approx(1.5))
    decision = decide(measured({"none": 1.0, "bf16": 0.1}, exposed={"none": 0.5, "bf16": 0.15}, most=8))
    assert (decision.compression, decision.accumulation_steps) == ("bf16", 8)
    assert decision.proposed_periodic_every == 8  # fp32's own measurements propose it


# The record.


def test_the_record_rebuilds_the_measurements_and_the_decision_reason_included():
    m = measured({"none": 0.1034, "bf16": 0.0712, "powersgd": 0.0651, "int8": 0.0649},
                 exposed={"none": 0.0611, "bf16": 0.0301, "powersgd": 0.0213, "int8": 0.0222},
                 noise={"none": 0.01, "bf16": 0.02, "powersgd": 0.031, "int8": 0.004}, margin=0.1, accumulation=2, most=8)
    decision = decide(m)
    assert decision.accumulation_reason is not None and decision.periodic_reason is not None
    # A JSON writer that sorts keys (json.dumps(sort_keys=True)) keeps the candidates' order too.
    record = json.loads(json.dumps({**m.record(), **decision.record()}, sort_keys=True))
    assert AutoMeasurements.from_record(record) == m
    assert AutoDecision.from_record(record) == decision
    assert decide(AutoMeasurements.from_record(record)) == AutoDecision.from_record(record)
    # The keys reports and benchmarks read.
    assert record["step_time_s"]["none"] == 0.1034 and record["baseline_exposed_comm_s"] == 0.0611
    assert record["compression"] == decision.compression and record["accumulation_steps"] == decision.accumulation_steps
    assert record["proposed_periodic_every"] == decision.proposed_periodic_every


# Pure helpers: a trial's cost and the bucket size.


def test_a_trial_costs_its_median_step_so_a_candidate_whose_steps_swing_pays_for_its_slow_half():
    # A candidate whose steps swing (every other one waits on the link) costs what it runs at:
    # a lower quartile would have put it at its fast steps (1.26 s) and beside a steady 1.3 s.
    assert typical_step_s([1.25, 1.55, 1.26, 1.50, 1.27, 1.60]) == pytest.approx(1.385)
    # One step slowed by a neighbour, or one lucky step, moves it little.
    assert typical_step_s([0.93, 0.95, 0.86, 0.84, 0.83, 1.90]) == pytest.approx(0.895)
    assert typical_step_s([0.50, 1.00, 1.00, 1.00, 1.00]) == 1.00
    assert typical_step_s([0.7]) == 0.7  # a trial of one step costs that step


def test_bucket_size_is_a_thirtieth_of_the_gradient_bytes_between_1_and_25_mb():
    mb = 2**20
    assert bucket_cap_mb_for(0) == 1.0
    assert bucket_cap_mb_for(30 * mb) == 1.0  # the floor's edge
    assert bucket_cap_mb_for(31 * mb) == 1.03
    assert bucket_cap_mb_for(256 * mb) == 8.53
    assert bucket_cap_mb_for(749 * mb) == 24.97
    assert bucket_cap_mb_for(750 * mb) == 25.0  # the cap's edge: DDP's default suits larger models
    assert bucket_cap_mb_for(4096 * mb) == 25.0


def test_auto_bucket_size_follows_the_gradient_bytes():
    # On the meta device a model has sizes but no memory: 256 MB and 1 GB models cost nothing here.
    assert auto_bucket_cap_mb(torch.nn.Linear(10, 10)) == 1.0
    assert auto_bucket_cap_mb(torch.nn.Linear(2048, 2048, device="meta")) == 1.0  # 16 MB of gradients: the floor
    assert auto_bucket_cap_mb(torch.nn.Linear(8192, 8192, device="meta")) == 8.53  # 256 MB / 30
    assert auto_bucket_cap_mb(torch.nn.Embedding(250_000, 1024, device="meta")) == 25.0
    # Frozen parameters have no gradients to send.
    frozen = torch.nn.Sequential(torch.nn.Embedding(250_000, 1024, device="meta"), torch.nn.Linear(8192, 8192, device="meta"))
    frozen[0].weight.requires_grad_(False)
    assert auto_bucket_cap_mb(frozen) == 8.53
    assert DDPConfig(bucket_cap_mb="auto").bucket_cap_mb == "auto"
    with pytest.raises(ConfigError, match="or 'auto'"):
        DDPConfig(bucket_cap_mb="big")


# The tuner: every rank's trials agreed on in one collective, decided, applied and logged.


def _tuner_deciding_on(timings, margin=0.05, max_accumulation_steps=1):
    """An AutoTuner whose trials measured, on this rank, `timings[rank][name]` = (median step, exposed share,
    jitter): every trial's five steps spread by `jitter` around the median (its noise), each waiting
    that share of itself."""
    dist.init_process_group("gloo")
    mine = timings[dist.get_rank()]
    config = CompressionConfig(name="auto", max_accumulation_steps=max_accumulation_steps)
    said: list[str] = []
    tuner = AutoTuner(config, margin=margin, candidates=tuple(mine), log=said.append)
    before = tuner.describe()
    for trial in tuner.trials:
        median, share, jitter = mine[trial.name]
        trial.step_times = [median * (1 - jitter), median, median, median * (1 + jitter), median * (1 + 3 * jitter)]
        trial.exposed_times = [share * step for step in trial.step_times]
    tuner._decide()
    record = tuner.describe()
    result = {"before": before, "record": json.loads(json.dumps(record)), "said": said,
              "kept": [t.name for t in tuner.trials if t.hook is not None], "accumulation_steps": tuner.accumulation_steps,
              "same_as_decided": decide(tuner.measurements) == tuner.decision}
    dist.destroy_process_group()
    return result


@pytest.mark.launches
def test_the_ranks_decide_on_the_slowest_step_the_least_exposed_wait_and_the_noisiest_trial():
    timings = [
        {"none": (0.100, 0.60, 0.01), "bf16": (0.070, 0.43, 0.01), "int8": (0.069, 0.45, 0.06)},
        {"none": (0.104, 0.50, 0.02), "bf16": (0.066, 0.60, 0.01), "int8": (0.072, 0.30, 0.01)},
    ]
    results = launch(_tuner_deciding_on, 2, timings=timings, margin=0.10, max_accumulation_steps=8)
    for result in results:
        record = result["record"]
        assert record == results[0]["record"], "every rank holds the same record"
        assert result["before"] == {"compression": None, "accumulation_steps": 1, "margin": 0.10}
        assert record["step_time_s"] == {"none": pytest.approx(0.104), "bf16": pytest.approx(0.070), "int8": pytest.approx(0.072)}
        # The least-waiting rank's share of the slowest rank's step: never more than the step.
        assert record["exposed_comm_s"] == {"none": pytest.approx(0.50 * 0.104), "bf16": pytest.approx(0.43 * 0.070),
                                            "int8": pytest.approx(0.30 * 0.072)}
        assert record["noise"] == {"none": pytest.approx(0.02), "bf16": pytest.approx(0.01), "int8": pytest.approx(0.06)}
        assert record["tie"] == TIE and record["margin"] == 0.10
        # bf16 is the fastest (70 ms against int8's 72). It leaves 43% exposed: accumulation 7 of the 8 allowed.
        decision = AutoDecision.from_record(record)
        assert (decision.compression, decision.accumulation_steps) == ("bf16", 7)
        assert result["accumulation_steps"] == 7 and result["kept"] == ["bf16"]  # the others' state is let go
        assert result["same_as_decided"]
        assert decide(AutoMeasurements.from_record(record)) == decision
        assert result["said"] == decision.messages() and len(result["said"]) == 3


def _tuner_resumed():
    dist.init_process_group("gloo")
    tuner = AutoTuner(CompressionConfig(name="auto", max_accumulation_steps=4), log=print)
    tuner.load_state_dict({"chosen": "int8", "accumulation_steps": 4, "hook": {}})
    result = {"record": tuner.describe(), "kept": [t.name for t in tuner.trials if t.hook is not None], "deciding": tuner.deciding}
    dist.destroy_process_group()
    return result


@pytest.mark.launches
def test_a_resumed_tuner_keeps_its_choice_without_claiming_measurements():
    (result,) = launch(_tuner_resumed, 1)
    assert result == {"record": {"compression": "int8", "accumulation_steps": 4, "margin": 0.10}, "kept": ["int8"],
                      "deciding": False}
