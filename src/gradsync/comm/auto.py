"""`compression="auto"`: pick the gradient communication for this model on this network by trying it.

Models of step time (bandwidth x bytes, minus what overlaps with backward, plus codec cost) are
easy to write and easy to get wrong: overlap, the codec's CPU cost competing with the backward,
and per-message latency all vary by machine. So auto measures instead: after a short warm-up it
runs a few real training steps with each candidate, measures every rank's step time (the
slowest rank counts), and keeps the fastest. A compressor must beat plain fp32 by more than
`margin` to be chosen, because compression costs accuracy and often loses on fast links; on a
fast network auto therefore keeps plain fp32. Between compressors, speed decides: they train
alike (within a point of each other on the digits demo), so the fastest wins; only a less
lossy one within `TIE` of it (a difference no user would notice) wins instead. The trials'
noise does not widen that tie: when two compressors are closer than their trials can tell
apart, either is as good a guess for speed, and accuracy is kept by both, so the measured
faster one is kept (and the log says the call was close).

The trials run in a palindrome, fp32, bf16, PowerSGD, int8 (twice as long), PowerSGD, bf16,
fp32: each candidate's steps are then centred on the same moment, so a step time that drifts
steadily while the run warms up (or another job starts) shifts every candidate alike instead
of favouring whoever ran last. A trial's step time is the median of its steps
(`typical_step_s`), and the noise is measured, not assumed: the spread of each trial's steps
around their median.

By default nothing about the batch changes: the global batch size stays the user's. Only
when the user allows it (`max_accumulation_steps` > 1) and communication still leaves more than
`margin` of the chosen step exposed does auto also pick more micro-batches per optimizer step:
the smallest multiple of the user's accumulation that brings the exposed share under `margin`
(one all-reduce per k micro-batches leaves 1/k of the exposed time per sample). That one is
predicted, not tried: a trial would have to run k times longer, and the trainer applies it at
the next batch where such a window can start (see AccumulationPlan).

Every rank sees the same all-reduced timings, so every rank makes the same choice at the same
step, without another agreement round.

Timing steps on a busy machine is noisy: a trial of a few steps can look 10-20% faster than
the baseline by chance. So a compressor must also beat fp32 by more than the two trials' noise
(`_noise_between`: twice their spreads combined), measured, not assumed. The communication fp32
left exposed (backward waiting for the last all-reduce, on the rank that waited least) only
explains the choice: on a CPU, Gloo's threads compete with backward for the cores, so a
compressor can save more than the share that visibly waited (a 300 Mbit/s trial: 9% exposed,
27% faster with PowerSGD). When exposure and step times disagree, the step times win, and the
log says so.

The decision is a pure function of what was measured: the tuner agrees on an `AutoMeasurements`
(every candidate's step time, exposed communication and noise, the margin, the user's
accumulation and its allowed maximum) and `decide` turns it into an `AutoDecision` (compressor,
accumulation, proposed period, and the sentences logged to say why), with no timing or
collective of its own. Both are kept in `AutoTuner.describe()`, i.e. `trainer.summary()["auto"]`
and the benchmark's JSON ("chosen"), so a decision can be re-made from its record:
`decide(AutoMeasurements.from_record(r)) == AutoDecision.from_record(r)`, reason text included.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from gradsync.comm.compression import CompressionConfig, CompressionHook, CompressionStats, make_hook
from gradsync.distributed import collective_device
from gradsync.metrics.timing import synchronized_time

# Least lossy first: on a tie the earlier one wins.
CANDIDATES = ("none", "bf16", "powersgd", "int8")
WARMUP_STEPS = 5
STEPS_PER_TRIAL = 3  # measured steps per segment of the palindrome, after one step that pays for the switch
TIE = 0.02  # compressors closer than this count as equally fast: the less lossy wins
PERIODIC_MOST = 1 << 20  # the longest period auto would propose (steps between agreements)


def trial_schedule(candidates: int, steps_per_trial: int) -> list[tuple[int, int]]:
    """(candidate, measured steps) per segment: there and back, the turning candidate once, twice as long."""
    there = list(range(candidates))
    return [(c, 2 * steps_per_trial if c == there[-1] else steps_per_trial) for c in there + there[-2::-1]]


def typical_step_s(times: list[float]) -> float:
    """What a candidate's step costs: the median of its measured steps.

    Not a lower quantile: on a shaped link a candidate's own steps swing (bf16's 21 MB a step
    queue behind each other, so some steps wait and some do not), and the swing is part of its
    cost. Lower quartiles twice measured bf16 faster in its trial than in its long run (1.26 s
    against 1.42 s at 300 Mbit/s), and auto chose it over a PowerSGD that was faster settled.
    What the median leaves out is what does not belong to the candidate: the step after each
    switch is not measured at all, and one step slowed by a neighbour moves it little.
    """
    return statistics.median(times)


# Optimizer steps before auto has decided: warm-up, then every segment with its switch step.
DECISION_STEPS = WARMUP_STEPS + sum(steps + 1 for _, steps in trial_schedule(len(CANDIDATES), STEPS_PER_TRIAL))


def choose_accumulation(step_s: float, exposed_s: float, current: int, most: int, margin: float) -> tuple[int, float, float]:
    """Micro-batches per step (a multiple of `current`, at most `most`), and the step time and
    exposed share predicted with it.

    A step of `current` micro-batches taking `step_s`, `exposed_s` of it waiting for
    communication, computes for `step_s - exposed_s`; with k micro-batches it computes
    k / current times as long and still waits once. Accumulation grows the global batch, so
    it is raised only when the exposed share is at least `margin`, and only as far as it takes
    to bring it under `margin`. Timings from different ranks can put the exposed time above the
    step time: then nothing is left to spread the wait over (no compute), and no k helps.
    """
    compute_s = max(0.0, step_s - exposed_s)

    def step_with(k: int) -> float:
        return step_s + (k - current) / current * compute_s

    def share(k: int) -> float:
        return _ratio(exposed_s, step_with(k))

    chosen = current
    larger = range(2 * current, most + 1, current)
    if share(current) >= margin and larger:
        # The share falls as k grows: the first multiple under the margin, else the largest allowed.
        # A search, not a walk: with little compute (or a margin of 0) no k gets there, and walking
        # a proposed period's 2**20 multiples took half a second of the user's step.
        first_under = bisect.bisect_left(larger, True, key=lambda k: share(k) < margin)
        chosen = larger[min(first_under, len(larger) - 1)]
    return chosen, step_with(chosen), share(chosen)


def _ratio(part: float, whole: float) -> float:
    """part / whole, 0 for a whole that is not positive: a degenerate timing decides nothing and raises nothing."""
    return part / whole if whole > 0 else 0.0


def bucket_cap_mb_for(gradient_bytes: int) -> float:
    """A bucket size from the gradient bytes: about 30 buckets, between 1 and 25 MB.

    Backward ends with the last bucket (the model's first layers) still to reduce, so at least
    that bucket's transfer is exposed; smaller buckets also start communicating earlier. Each
    bucket pays the collective's fixed latency (tens of microseconds on NCCL, a few hundred on
    Gloo), which a 1 MB floor keeps small against its transfer. Measured on ResNet-18 (45 MB of
    gradients; tensors over the cap get a bucket each) between two hosts at 300 Mbit/s with
    bf16: 25 MB buckets (DDP's default) left 17% of the step exposed, 5.3 MB (6 buckets) 5%,
    1.4 MB (10 buckets, this rule) 3%. DDP's 25 MB suits models of 750 MB and more.
    """
    return round(min(25.0, max(1.0, gradient_bytes / 2**20 / 30)), 2)


def auto_bucket_cap_mb(model: torch.nn.Module) -> float:
    """`bucket_cap_mb='auto'`: bucket_cap_mb_for the bytes of the model's trainable parameters' gradients."""
    return bucket_cap_mb_for(sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad))


@dataclass(frozen=True)
class CandidateTiming:
    """One candidate's trial, as every rank agreed on it."""

    name: str
    step_s: float  # its typical step (typical_step_s), slowest rank
    # Its exposed communication per step: the median share of a step that waited (least-waiting
    # rank) times step_s. A share of the same steps, not a median of waits beside a quartile of
    # steps: when a trial's first steps were slow, that put fp32's wait at 130-312% of its step.
    exposed_s: float
    noise: float  # median absolute deviation of its steps / their median, noisiest rank


@dataclass(frozen=True)
class AutoMeasurements:
    """Everything `decide` reads: the trials and the rules auto was given."""

    candidates: tuple[CandidateTiming, ...]  # fp32 first, then least lossy first (a tie goes to the earlier)
    margin: float  # the share of fp32's step a compressor must save, and the exposed share worth hiding
    accumulation_steps: int  # the user's micro-batches per step, under which the trials ran
    max_accumulation_steps: int  # the most auto may choose (the user's count: accumulation stays)

    @property
    def baseline(self) -> CandidateTiming:
        return self.candidates[0]

    def record(self) -> dict[str, Any]:
        """The keys of `AutoTuner.describe()` that hold the measurements (JSON: floats round-trip exactly)."""
        return {
            "candidates": [c.name for c in self.candidates],
            "step_time_s": {c.name: c.step_s for c in self.candidates},
            "baseline_exposed_comm_s": self.baseline.exposed_s,
            "exposed_comm_s": {c.name: c.exposed_s for c in self.candidates},
            "noise": {c.name: c.noise for c in self.candidates},
            "margin": self.margin,
            "measured_accumulation_steps": self.accumulation_steps,
            "max_accumulation_steps": self.max_accumulation_steps,
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> AutoMeasurements:
        """The measurements in a record written by `record()` (e.g. `trainer.summary()["auto"]`)."""
        return cls(
            candidates=tuple(
                CandidateTiming(name, record["step_time_s"][name], record["exposed_comm_s"][name], record["noise"][name])
                for name in record["candidates"]
            ),
            margin=record["margin"],
            accumulation_steps=record["measured_accumulation_steps"],
            max_accumulation_steps=record["max_accumulation_steps"],
        )


@dataclass(frozen=True)
class AutoDecision:
    """What auto chose from its measurements, and the sentences it logs to say why."""

    compression: str
    reason: str  # the compressor's log line
    accumulation_steps: int  # micro-batches per step from now on (the user's unless allowed and worth it)
    predicted_step_s: float  # the chosen compressor's step with that many micro-batches
    predicted_exposed_share: float  # ... and the share of it still waiting for communication
    accumulation_reason: str | None  # its log line; None when accumulation was not allowed to change
    proposed_periodic_every: int | None  # ddp.periodic.every auto proposes (never applies)
    periodic_reason: str | None  # its log line, with the proposal

    def messages(self) -> list[str]:
        """The log lines, in the order auto logs them."""
        return [m for m in (self.reason, self.accumulation_reason, self.periodic_reason) if m is not None]

    def record(self) -> dict[str, Any]:
        """The keys of `AutoTuner.describe()` that hold the decision."""
        return {
            "compression": self.compression,
            "reason": self.reason,
            "accumulation_steps": self.accumulation_steps,
            "predicted_step_s": self.predicted_step_s,
            "predicted_exposed_share": self.predicted_exposed_share,
            "accumulation_reason": self.accumulation_reason,
            "proposed_periodic_every": self.proposed_periodic_every,
            "periodic_reason": self.periodic_reason,
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> AutoDecision:
        return cls(**{key: record[key] for key in cls.__dataclass_fields__})


def decide(measured: AutoMeasurements) -> AutoDecision:
    """auto's choice, from the measurements alone (see the module's docstring for the rules)."""
    baseline, margin = measured.baseline, measured.margin
    exposed_share = _ratio(baseline.exposed_s, baseline.step_s)
    # Faster than fp32 by more than the margin (compression costs accuracy) and by more than the
    # two trials' noise (a few steps on a busy machine can look faster by chance).
    faster = [c for c in measured.candidates[1:] if c.step_s < baseline.step_s * (1 - margin)]
    winners = [c for c in faster if _ratio(baseline.step_s - c.step_s, baseline.step_s) > _noise_between(baseline, c)]
    best, runner_up = baseline, None
    if winners:
        fastest = min(winners, key=lambda c: c.step_s)
        # The least lossy compressor within the tie of the fastest (candidates are least lossy first).
        best = next(c for c in winners if c.step_s <= fastest.step_s * (1 + TIE))
        runner_up = min((c for c in winners if c is not best), key=lambda c: c.step_s, default=None)
    timings = ", ".join(f"{c.name} {c.step_s * 1e3:.1f} ms" for c in measured.candidates)
    exposed = f"fp32 left {baseline.exposed_s * 1e3:.1f} ms ({exposed_share:.0%}) of each step waiting for communication"
    if best is baseline:
        why = f"no compressor was more than {margin:.0%} faster than fp32"
        if faster:
            why += " beyond the trials' noise"
        if exposed_share >= margin:
            why += (f", although {exposed}: the step times win (a compressor's own cost on the cores took what it "
                    "saved on the wire)")
        else:
            why += f" ({exposed}: the network keeps up with the compute)"
        why += ", so gradients stay exact"
    else:
        cut = f"{best.name} cut the step time by {1 - _ratio(best.step_s, baseline.step_s):.0%}, beyond the trials' noise"
        if exposed_share >= margin:
            why = f"{exposed}; {cut} (communication was the bottleneck"
        else:
            why = (f"{cut}, although {exposed}: the step times win (Gloo's threads compete with backward for the "
                   "cores, so the share that waited understates what communication costs")
        why += f"; compressors within {TIE:.0%} of the fastest count as tied and the least lossy of them wins)"
        # A zero step time has no ratio to the runner-up's: no close call is claimed then.
        if runner_up is not None and best.step_s > 0 and abs(runner_up.step_s / best.step_s - 1) < _noise_between(best, runner_up):
            why += (f". {runner_up.name} was within the trials' noise of it ({runner_up.step_s / best.step_s - 1:+.1%}): "
                    "a close call between two compressors that keep accuracy alike")
    reason = f"auto compression chose {best.name}: {why}. Step times (median of each trial): {timings}."
    current = measured.accumulation_steps
    steps, predicted_step_s, predicted_share = choose_accumulation(
        best.step_s, best.exposed_s, current, measured.max_accumulation_steps, margin
    )
    accumulation_reason = None
    if measured.max_accumulation_steps > current:
        waited = f"with {best.name}, {_ratio(best.exposed_s, best.step_s):.0%} of each step still waited for communication"
        if steps == current:
            accumulation_reason = (f"auto kept accumulation as it is ({current} per step): {waited}, under the "
                                   f"{margin:.0%} worth growing the global batch for.")
        else:
            per_sample = _ratio(predicted_step_s, steps / current * best.step_s)
            accumulation_reason = (
                f"auto raises accumulation from {current} to {steps} micro-batches per step "
                f"(allowed up to {measured.max_accumulation_steps}): {waited}; one all-reduce per {steps} "
                f"micro-batches should leave {predicted_share:.0%} exposed and take {1 - per_sample:.0%} less time per sample."
            )
    every, periodic_reason = _propose_periodic(measured, best)
    return AutoDecision(best.name, reason, steps, predicted_step_s, predicted_share, accumulation_reason, every, periodic_reason)


def _noise_between(a: CandidateTiming, b: CandidateTiming) -> float:
    """The difference two trials' step times can show by chance: twice their spreads combined."""
    return 2 * (a.noise**2 + b.noise**2) ** 0.5


def _propose_periodic(measured: AutoMeasurements, best: CandidateTiming) -> tuple[int | None, str | None]:
    """How rarely the ranks would have to agree for communication to stop mattering, when the
    chosen compressor still leaves `margin` of its step exposed; said, never applied.

    An agreement all-reduces the parameters, as many bytes as fp32's gradients, after the
    step: it costs about fp32's exposed time, once per `every` steps.
    """
    left = _ratio(best.exposed_s, best.step_s)
    if best.step_s <= 0 or left < measured.margin:
        return None, None
    baseline = measured.baseline
    every, _, predicted = choose_accumulation(baseline.step_s, baseline.exposed_s, 1, PERIODIC_MOST, measured.margin)
    return every, (
        f"with {best.name}, {left:.0%} of each step still waits for communication. "
        f"Synchronising every {every} steps instead (ddp={{'periodic': {{'every': {every}}}}}, local SGD; "
        f"compression 'none') should leave about {predicted:.0%}; it changes the optimisation, so auto does not "
        "apply it: measure its accuracy first (docs/performance.md)."
    )


class PlainHook(CompressionHook):
    """fp32 all-reduce of the whole bucket, in place, with the compressors' accounting (auto's baseline)."""

    def __call__(self, state, bucket):  # type: ignore[no-untyped-def]  # a DDP hook (see compression.py)
        buffer = bucket.buffer()
        self.stats.raw_bytes += buffer.numel() * buffer.element_size()
        self.stats.sent_bytes += buffer.numel() * buffer.element_size()
        buffer.div_(self.world_size)
        return self._all_reduce(buffer).then(lambda done: done.value()[0])


@dataclass
class Trial:
    name: str
    hook: CompressionHook | None  # None once another candidate is chosen
    step_times: list[float] = field(default_factory=list)  # this rank's
    exposed_times: list[float] = field(default_factory=list)  # this rank's exposed communication, one per step

    def spread(self) -> float:
        median = statistics.median(self.step_times)
        return statistics.median(abs(t - median) for t in self.step_times) / median if median > 0 else 0.0

    def exposed_share(self) -> float:
        """The median share of its steps spent waiting for communication (each wait within its step)."""
        return statistics.median(_ratio(e, t) for e, t in zip(self.exposed_times, self.step_times))


class AutoTuner:
    """Switches the communication hook between candidates during the first steps, then settles.

    The trainer calls `inner` for the hook to use and `step_done()` after every optimizer step.
    """

    def __init__(
        self,
        base: CompressionConfig,
        process_group: Any = None,
        *,
        warmup_steps: int = WARMUP_STEPS,
        steps_per_trial: int = STEPS_PER_TRIAL,
        margin: float = 0.10,
        candidates: tuple[str, ...] = CANDIDATES,
        accumulation_steps: int = 1,
        log: Callable[[str], None] = lambda message: None,
    ) -> None:
        """`accumulation_steps`: the trainer's micro-batches per step while auto measures."""
        self.process_group = process_group
        self.warmup_steps = warmup_steps
        self.margin = margin
        self.log = log
        self.stats = CompressionStats()  # shared, so per-step metrics stay continuous across switches
        self.trials = []
        for name in candidates:
            config = CompressionConfig(
                name=name,
                min_numel=base.min_numel,
                powersgd_rank=base.powersgd_rank,
                powersgd_start_step=0,  # its plain warm-up is auto's own; plain steps in its trial would hide its speed
                topk_ratio=base.topk_ratio,
            )
            hook = PlainHook(config, process_group) if name == "none" else make_hook(config, process_group)
            assert hook is not None
            hook.stats = self.stats
            self.trials.append(Trial(name, hook))
        self.chosen: Trial | None = None
        self.measured_accumulation = accumulation_steps
        self.max_accumulation = max(base.max_accumulation_steps, accumulation_steps)
        self.accumulation_steps = accumulation_steps  # auto's choice once decided (unchanged unless allowed)
        self.measurements: AutoMeasurements | None = None  # what every rank agreed it measured, once decided
        self.decision: AutoDecision | None = None  # decide(measurements)
        self.steps = 0
        self._schedule = trial_schedule(len(self.trials), steps_per_trial)
        self._position = -1  # warming up
        self._segment_steps = 0
        self._last: float = 0.0

    @property
    def current(self) -> CompressionHook:
        hook = (self.chosen or self.trials[self._schedule[min(max(0, self._position), len(self._schedule) - 1)][0]]).hook
        assert hook is not None
        return hook

    def __call__(self, state, bucket):  # type: ignore[no-untyped-def]  # a DDP hook (see compression.py)
        return self.current(state, bucket)

    def start(self, planned_steps: int | None) -> None:
        """Compression hooks' interface; auto's schedule does not depend on the run's length."""

    def bind(self, module: torch.nn.Module) -> None:
        """Compression hooks' interface: every candidate names the module's parameters."""
        for trial in self.trials:
            if trial.hook is not None:
                trial.hook.bind(module)

    @property
    def deciding(self) -> bool:
        return self.chosen is None

    def step_done(self, device: torch.device, exposed_s: float) -> None:
        """After each optimizer step (with its exposed communication): advance; decide after the last trial."""
        if self.chosen is not None:
            return
        self.steps += 1
        if self.steps < self.warmup_steps:
            return
        now = synchronized_time(device)
        if self._position >= 0:
            # The first step after a switch pays for the switch (new buffers, PowerSGD's first
            # low-rank pass), so it is left out of the trial's measurement.
            candidate, steps = self._schedule[self._position]
            if self._segment_steps > 0:
                trial = self.trials[candidate]
                trial.step_times.append(now - self._last)
                trial.exposed_times.append(exposed_s)
            self._segment_steps += 1
            self._last = now
            if self._segment_steps <= steps:
                return
        self._position += 1
        self._segment_steps = 0
        self._last = now
        if self._position == len(self._schedule):
            self._decide()

    def _decide(self) -> None:
        """Agree on the measurements, decide, keep the chosen hook and say why."""
        self.measurements = self._agreed_measurements()
        self.decision = decide(self.measurements)
        self._settle_on(next(t for t in self.trials if t.name == self.decision.compression))
        self.accumulation_steps = self.decision.accumulation_steps
        for message in self.decision.messages():
            self.log(message)

    def _agreed_measurements(self) -> AutoMeasurements:
        """Every rank's trials as one record, the same on every rank.

        One collective: MAX of the step times (the slowest rank sets the pace) and MAX of the
        negated exposed shares, i.e. the least exposed rank's, whose wait was only communication.
        And MAX of each trial's spread: the noisiest rank's.
        """
        n = len(self.trials)
        measured = [typical_step_s(t.step_times) for t in self.trials]
        measured += [-t.exposed_share() for t in self.trials]
        measured += [t.spread() for t in self.trials]
        values = torch.tensor(measured, dtype=torch.float64,
                              device=collective_device(self.process_group) if dist.is_initialized() else "cpu")
        if dist.is_initialized():
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.process_group)
        agreed = values.tolist()
        return AutoMeasurements(
            candidates=tuple(
                CandidateTiming(trial.name, step_s, max(0.0, -negated_share) * step_s, noise)
                for trial, step_s, negated_share, noise in zip(self.trials, agreed, agreed[n : 2 * n], agreed[2 * n :])
            ),
            margin=self.margin,
            accumulation_steps=self.measured_accumulation,
            max_accumulation_steps=self.max_accumulation,
        )

    def _settle_on(self, trial: Trial) -> None:
        """Keep `trial`'s hook and let the others go: their residuals and PowerSGD's errors are
        as large as the gradients (int8's and PowerSGD's together, 8 bytes a parameter)."""
        self.chosen = trial
        for other in self.trials:
            if other is not trial:
                other.hook = None

    def describe(self) -> dict[str, Any]:
        """What auto measured and chose (trainer.summary()["auto"], reports, the benchmark JSON).

        Until it decides (and in a run resumed from a checkpoint, which keeps the choice but not
        the trials) only the choice so far; once decided, also `AutoMeasurements.record()` and
        `AutoDecision.record()`, from which `from_record` rebuilds both.
        """
        description: dict[str, Any] = {
            "compression": None if self.chosen is None else self.chosen.name,
            "accumulation_steps": self.accumulation_steps,
            "margin": self.margin,
        }
        if self.measurements is not None and self.decision is not None:
            description.update(**self.measurements.record(), **self.decision.record(), tie=TIE)
        return description

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "chosen": None if self.chosen is None else self.chosen.name,
            "accumulation_steps": self.accumulation_steps,
        }
        if self.chosen is not None and self.chosen.hook is not None:
            state["hook"] = self.chosen.hook.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        chosen = state.get("chosen")
        if chosen is not None:
            self._settle_on(next(t for t in self.trials if t.name == chosen))
            assert self.chosen is not None and self.chosen.hook is not None
            self.chosen.hook.load_state_dict(state.get("hook", {}))
            self.accumulation_steps = state.get("accumulation_steps", self.accumulation_steps)

