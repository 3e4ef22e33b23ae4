"""What to do next, from what the run measured: at most five recommendations, most at stake first.

Each rule is a function of the run's records (metrics rows, profile breakdowns, the diagnosis,
and for a script without gradsync's trainer `gradsync run`'s per-rank timeline) that returns one
`Advice` or None. A rule speaks only when its number crosses a threshold the
seed articles' decision procedure uses (exposed communication above ~30% of a step, ranks'
busy time spread above ~15%, data loading a large share of the step, steps skipped for
overflow), and its advice quotes that number with the most it can gain: a step loses at most the
share at stake, so removing it makes steps at most 1 / (1 - share) times faster. A run with
nothing worth changing gets none.

Where a profiled step's time goes to neither data, forward, backward, communication nor the
optimizer ("other": a sleep, logging, a `.item()` that waits, Python between the phases), or to
data loading, the advice names the lines: the profile's hotspots (gradsync.profiling.hotspots),
the user's lines that the training thread's sampled stack spent that time at.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Any, Callable

from gradsync.errors import GradsyncError
from gradsync.report.collect import RunRecords, collect

MOST_SHOWN = 5
WARM_UP_STEPS = 3  # first optimizer steps left out: start-up, buckets rebuilt, auto's trials
EXPOSED_SHARE = 0.30  # exposed communication above this share of the step is worth attacking
BUSY_SPREAD_SHARE = 0.15  # ranks' busy time spread above this share of the median step: imbalance
DATA_SHARE = 0.20  # data loading above this share of the step
OTHER_SHARE = 0.20  # time in none of the phases above this share of the step
HOTSPOT_SHARE = 0.03  # a line is named when the sampled stack spent at least this share of the window there
HOTSPOTS_NAMED = 3
SKIPPED_SHARE = 0.10  # skipped optimizer steps above this share of the run
# Findings whose own suggestion is the advice (warnings a run can go on with).
ADVISED_WARNINGS = ("find_unused_parameters_unneeded", "accumulation_without_no_sync", "sampler_epoch_not_set",
                    "fsdp_root_holds_most", "straggler", "nonfinite_gradients")


@dataclass(frozen=True)
class Advice:
    """One recommendation: what was measured (with its number) and what to change."""

    rule: str
    at_stake: float  # share of step time (or of steps) involved: the ranking key
    measured: str
    action: str
    rank: int | None = None  # the rank it is about, when one is


_IMBALANCE_REMEDY = (
    "every rank waits for it at each reduction: look at what only it does (logging, evaluation), its data loading "
    "(num_workers), its machine (CPU, GPU clocks, other jobs: the machine plots below) and whether its batches are larger"
)


def _at_most_faster(share: float, what: str) -> str:
    """The gain's upper bound: a step loses at most the share at stake."""
    return f" ({what}, steps would be at most {1 / max(1e-9, 1 - share):.2g}x faster)"


def _lines(records: RunRecords, rank: int, kinds: tuple[str, ...]) -> str:
    """The profile's top lines of `kinds` on `rank`, "train.py:42 in step (35%), ...", or ""."""
    spots = [h for h in (records.breakdowns.get(rank) or {}).get("hotspots") or []
             if h.get("kind") in kinds and h.get("share", 0) >= HOTSPOT_SHARE]
    return ", ".join(f"{h['where']} in {h['function']} ({h['share']:.0%})" for h in spots[:HOTSPOTS_NAMED])


def _largest_share(records: RunRecords, part: str) -> tuple[int, float] | None:
    """The rank whose profiled steps spend the largest share in `part` (a breakdown's "data_s"...), and that share."""
    shares = {
        rank: b["mean"][part] / b["mean"]["step_s"]
        for rank, b in records.breakdowns.items()
        if b.get("mean", {}).get("step_s") and b["mean"].get(part) is not None
    }
    if not shares:
        return None
    rank = max(shares, key=shares.__getitem__)
    return rank, shares[rank]


def _steady(records: RunRecords) -> list[dict[str, Any]]:
    rows = records.rows
    return rows[WARM_UP_STEPS:] if len(rows) > WARM_UP_STEPS else rows


def failed_run(records: RunRecords) -> Advice | None:
    """A failed run's first error comes before anything about speed."""
    diagnosis = records.diagnosis or {}
    errors = [f for f in diagnosis.get("findings") or [] if f.get("severity") == "error"]
    if diagnosis.get("status") != "failed" or not errors:
        return None
    first = errors[0]
    where = "; ".join(f"rank {r}: {loc}" for r, loc in (first.get("locations") or {}).items())
    return Advice(
        "failed_run", float("inf"),
        f"the run failed: {first.get('category')}" + (f" ({where})" if where else ""),
        str(first.get("suggestion", "see the diagnosis below")),
    )


_UNMODIFIED_REMEDIES = (
    "send fewer bytes per sample: accumulate micro-batches under ddp.no_sync(), register a compression hook "
    "(ddp.register_comm_hook(None, bf16_compress_hook)), or move the loop to gradsync's trainer with "
    "ddp={'compression': 'auto'}, which measures them on the run; `gradsync bench train` compares them side by side"
)


def exposed_communication(records: RunRecords) -> Advice | None:
    recorded = records.recorded
    if recorded is not None:
        # The slowest rank's wait: it arrives last at each collective, so what it waits for is the transfer.
        share = statistics.median(recorded.communication_share())
        if share <= EXPOSED_SHARE:
            return None
        return Advice("exposed_communication", share,
                      f"communication takes {share:.0%} of the time even on the rank that waits least for the others"
                      + _at_most_faster(share, "all of it hidden"),
                      _UNMODIFIED_REMEDIES)
    rows = _steady(records)
    total = sum(r["step_time_s"] for r in rows)
    if not rows or total <= 0:
        return None
    share = sum(r["exposed_comm_s"] for r in rows) / total
    if share <= EXPOSED_SHARE:
        return None
    bubbles = [r["pipeline_bubble_share"] for r in rows if r.get("pipeline_bubble_share") is not None]
    if bubbles:
        return _pipeline_bubble(share, statistics.fmean(bubbles))
    link = [r["busbw_gbps"] for r in rows if r.get("busbw_gbps")]
    on_link = f" while the gradient all-reduce reached {statistics.median(link):.2f} GB/s bus bandwidth" if link else ""
    compressed = any((r.get("compression_ratio") or 1.0) > 1.0 for r in rows)
    if compressed:
        action = ("the gradients are compressed already: accumulate more micro-batches per step "
                  "(accumulation_steps), so the same traffic serves more samples, or check the network "
                  "with `gradsync doctor` (a slower link than the hosts have, or the wrong interface)")
    else:
        action = ("let gradsync measure the remedies on this run: ddp={'compression': 'auto', "
                  "'bucket_cap_mb': 'auto'} (it tries fp16, bf16, int8, top-k and PowerSGD in the first "
                  "steps and keeps the fastest), or accumulate micro-batches (accumulation_steps); "
                  "`gradsync bench train` compares them side by side")
    return Advice("exposed_communication", share,
                  f"exposed communication is {share:.0%} of the step{on_link}" + _at_most_faster(share, "all of it hidden"),
                  action)


def _pipeline_bubble(exposed: float, bubble: float) -> Advice:
    """Under a pipeline the step's waiting is mostly its bubble (stages idle for their neighbours'
    micro-batches), which compression does not shorten: more micro-batches, interleaving and an
    even cut do."""
    return Advice(
        "exposed_communication", exposed,
        f"the pipeline's stages wait {bubble:.0%} of the step for each other (its bubble), of {exposed:.0%} spent "
        "waiting for communication" + _at_most_faster(exposed, "all of it hidden"),
        "shrink the bubble: more micro-batches per batch (parallel={'microbatches': ...}, with a larger batch), the "
        "interleaved 1F1B schedule (stages_per_rank=2), or split points that give every stage the same compute (the "
        "stage the others wait for is the busiest rank: move a block off it)",
    )


def rank_imbalance(records: RunRecords) -> Advice | None:
    recorded = records.recorded
    if recorded is not None and len(recorded.ranks) > 1:
        spread = statistics.median(recorded.imbalance_share())
        if spread <= BUSY_SPREAD_SHARE:
            return None
        slowest = recorded.slowest_rank()
        rank = statistics.mode(slowest)
        return Advice(
            "rank_imbalance", spread,
            f"rank {rank} is the one the others wait for in {slowest.count(rank)} of {len(slowest)} intervals: "
            f"the others wait up to {spread:.0%} of the time more than it does" + _at_most_faster(spread, "balanced"),
            _IMBALANCE_REMEDY,
            rank,
        )
    intervals = [r for r in records.intervals if r.get("busy_spread_s") is not None]
    steps = [r["step_time_s"] for r in _steady(records)]
    if not intervals or not steps:
        return None
    step = statistics.median(steps)
    spread = statistics.median(r["busy_spread_s"] for r in intervals) / step if step > 0 else 0.0
    if spread <= BUSY_SPREAD_SHARE:
        return None
    slowest = statistics.mode(r.get("interval_slowest_rank") for r in intervals)
    return Advice(
        "rank_imbalance", spread,
        f"rank {slowest} is usually the busiest: the ranks' busy time per step differs by {spread:.0%} of a step"
        + _at_most_faster(spread, "balanced"),
        _IMBALANCE_REMEDY,
        slowest if isinstance(slowest, int) else None,
    )


def data_loading(records: RunRecords) -> Advice | None:
    found = _largest_share(records, "data_s")
    if found is None or found[1] <= DATA_SHARE:
        return None
    rank, share = found
    lines = _lines(records, rank, ("data",))
    return Advice(
        "data_loading", share,
        f"data loading takes {share:.0%} of the step on rank {rank} (profiled steps)"
        + (f", most at {lines}" if lines else "") + _at_most_faster(share, "loaded in the background"),
        "load batches in the background: prepare(..., num_workers=N) (or DataLoader(num_workers=N, "
        "pin_memory=True)), and move decoding and augmentation out of the training process",
        rank,
    )


def time_elsewhere(records: RunRecords) -> Advice | None:
    """The step's time outside every phase: the lines it goes to, from the profile's sampled stacks."""
    found = _largest_share(records, "other_s")
    if found is None or found[1] <= OTHER_SHARE:
        return None
    rank, share = found
    lines = _lines(records, rank, ("own",))
    where = (f": most at {lines}" if lines else
             " (profile it with `gradsync run --profile-steps A:B` or the trainer's metrics.profile_steps to name the lines)")
    return Advice(
        "time_elsewhere", share,
        f"{share:.0%} of the step on rank {rank} is none of data loading, forward, backward, communication "
        f"or the optimizer (profiled steps){where}" + _at_most_faster(share, "without it"),
        "take what those lines do out of the step or do it every N steps: a sleep or a wait, printing or logging, "
        "a .item() or .cpu() that waits for the device, evaluation or checkpointing inside the loop",
        rank,
    )


def skipped_steps(records: RunRecords) -> Advice | None:
    rows = _steady(records)
    if not rows:
        return None
    overflow = sum(1 for r in rows if r.get("skipped") == "overflow") / len(rows)
    nonfinite = sum(1 for r in rows if r.get("skipped") == "nonfinite") / len(rows)
    if overflow > SKIPPED_SHARE:
        return Advice("skipped_steps", overflow, f"fp16 gradients overflowed on {overflow:.0%} of the steps",
                      "the loss scale keeps collapsing: use precision='bf16' (no scaler), or lower the learning rate")
    if nonfinite > SKIPPED_SHARE:
        return Advice("skipped_steps", nonfinite, f"the gradient norm was not finite on {nonfinite:.0%} of the steps",
                      "the model is diverging: lower the learning rate, clip harder (max_grad_norm), or check the data")
    return None


# A measured rule that says what a warning says, with its number: the warning is not repeated.
_SAID_BY = {"straggler": "rank_imbalance"}


def warnings_to_act_on(records: RunRecords, measured: set[str] = frozenset()) -> list[Advice]:
    findings = (records.diagnosis or {}).get("findings") or []
    return [
        Advice(f["category"], 0.0, str(f.get("message", "")).split(". ")[0], str(f.get("suggestion", "")))
        for f in findings
        if f.get("severity") == "warning" and f.get("category") in ADVISED_WARNINGS
        and _SAID_BY.get(f["category"]) not in measured
    ]


RULES: tuple[Callable[[RunRecords], Advice | None], ...] = (
    failed_run, exposed_communication, rank_imbalance, data_loading, time_elsewhere, skipped_steps,
)


def advise(records: RunRecords) -> list[Advice]:
    """The recommendations the run's numbers support, most at stake first, at most MOST_SHOWN."""
    found = [advice for rule in RULES if (advice := rule(records)) is not None]
    found = _one_advice_per_slow_rank(records, found)
    found.sort(key=lambda advice: advice.at_stake, reverse=True)
    return (found + warnings_to_act_on(records, {advice.rule for advice in found}))[:MOST_SHOWN]


def _one_advice_per_slow_rank(records: RunRecords, found: list[Advice]) -> list[Advice]:
    """The rank the others wait for is also the one whose step goes elsewhere: one advice, naming its lines."""
    waited_for = next((a for a in found if a.rule == "rank_imbalance" and a.rank is not None), None)
    if waited_for is None:
        return found
    elsewhere = next((a for a in found if a.rule == "time_elsewhere" and a.rank == waited_for.rank), None)
    if elsewhere is None:
        return found
    lines = _lines(records, waited_for.rank, ("own",))
    merged = dataclasses.replace(waited_for, measured=waited_for.measured + (f"; its steps go most to {lines}" if lines else ""))
    return [merged if a is waited_for else a for a in found if a is not elsewhere]


def advice_lines(run_dir: Any) -> list[str]:
    """The last lines of a healthy `gradsync run`: one per recommendation, pointing to the report.
    A failed run prints none (its diagnosis is what to do); a folder that cannot be read, none."""
    try:
        records = collect(run_dir)
    except GradsyncError:
        return []
    if (records.diagnosis or {}).get("status") not in (None, "ok"):
        return []
    return [f"advice: {a.measured.rstrip('.')} (what to do: `gradsync report {run_dir}`, 'What to do next')"
            for a in advise(records)]
