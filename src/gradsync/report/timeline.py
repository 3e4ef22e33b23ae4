"""Per-rank step times and communication waits of any script, from `gradsync run`'s readings.

Each worker logs, once a second, its cumulative optimizer steps, synchronised backward passes
and seconds spent waiting on communication (`SystemReading`). Differencing those counters
between readings gives, without touching the script, how long a step took on each rank and
what share of it the rank waited; waiting ranks wait for someone, and the rank that waits least
is the one the others wait for.

Ranks are aligned by step, not by clock (hosts' clocks differ; steps are in lockstep under data
parallelism): the counters are interpolated at common step edges, so the intervals of every rank
cover the same steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy

MOST_INTERVALS = 40  # enough to see a trend, few enough for a heat map cell to be visible
FEWEST_INTERVALS = 3  # fewer is not a timeline: a run of a few seconds, or one that hung early


@dataclass(frozen=True)
class Timeline:
    """Intervals of equal numbers of steps (or backward passes: `unit`) ending at `ends`, per rank."""

    unit: str  # "optimizer step" or "backward pass"
    ends: list[int]
    step_time_s: dict[int, list[float]]
    wait_share: dict[int, list[float]]  # of the interval's time, 0..1

    @property
    def ranks(self) -> list[int]:
        return sorted(self.step_time_s)

    def slowest_rank(self) -> list[int]:
        """Per interval, the rank that waited least: the one the others waited for."""
        return [min(self.ranks, key=lambda rank: self.wait_share[rank][i]) for i in range(len(self.ends))]

    def communication_share(self) -> list[float]:
        """Per interval, the slowest rank's wait: communication itself. It arrives last at each
        collective, so what it waits for is the transfer, not another rank; the others' extra
        wait is for it."""
        return [min(self.wait_share[rank][i] for rank in self.ranks) for i in range(len(self.ends))]

    def imbalance_share(self) -> list[float]:
        """Per interval, how much longer the most waiting rank waited than the slowest one."""
        return [max(self.wait_share[rank][i] for rank in self.ranks) - low for i, low in enumerate(self.communication_share())]


def counter(system: dict[int, list[dict[str, Any]]]) -> str | None:
    """Optimizer steps when the script's optimizer was seen stepping, else DDP's backward passes."""
    for key in ("optimizer_steps", "backward_passes"):
        if any((row.get(key) or 0) > 0 for rows in system.values() for row in rows):
            return key
    return None


def _first_sightings(rows: list[dict[str, Any]], key: str) -> list[tuple[int, float, float]]:
    """(count, time, wait) at the first reading of each count, in order: strictly increasing counts."""
    points: list[tuple[int, float, float]] = []
    for row in sorted(rows, key=lambda r: r["time"]):
        count, wait = row.get(key), row.get("communication_wait_s")
        if not isinstance(count, int) or not isinstance(wait, (int, float)):
            continue
        if not points or count > points[-1][0]:
            points.append((count, float(row["time"]), float(wait)))
    return points


def timeline(system: dict[int, list[dict[str, Any]]]) -> Timeline | None:
    """The ranks' intervals, or None when the readings hold no steps (or too few readings)."""
    key = counter(system)
    if key is None:
        return None
    points = {rank: _first_sightings(rows, key) for rank, rows in system.items()}
    points = {rank: p for rank, p in points.items() if len(p) >= 2}
    if not points:
        return None
    low = max(p[0][0] for p in points.values())
    high = min(p[-1][0] for p in points.values())
    # No finer than the readings: a second's counters interpolated into many bins invent detail.
    intervals = min(MOST_INTERVALS, min(len(p) for p in points.values()) - 1, high - low)
    if intervals < FEWEST_INTERVALS:
        return None
    width = math.ceil((high - low) / intervals)
    edges = list(range(low, high + 1, width))  # at least two: width <= high - low
    step_time: dict[int, list[float]] = {}
    wait_share: dict[int, list[float]] = {}
    for rank, p in sorted(points.items()):
        counts, moments, waited = zip(*p)
        times, waits = numpy.interp(edges, counts, moments), numpy.interp(edges, counts, waited)
        step_time[rank], wait_share[rank] = [], []
        for i in range(1, len(edges)):
            elapsed = times[i] - times[i - 1]
            step_time[rank].append(float(elapsed / (edges[i] - edges[i - 1])))
            wait_share[rank].append(float(min(1.0, max(0.0, (waits[i] - waits[i - 1]) / elapsed))) if elapsed > 0 else 0.0)
    unit = "optimizer step" if key == "optimizer_steps" else "backward pass"
    return Timeline(unit, edges[1:], step_time, wait_share)


def step_at(system_rows: list[dict[str, Any]], key: str | None) -> list[float] | None:
    """Each reading's step count, for plotting machine readings on the step axis (None: no steps)."""
    if key is None:
        return None
    return [float(row.get(key) or 0) for row in system_rows]

