"""Which rank the others wait for at every collective: StragglerTracker keeps the ranks' arrival
times across the monitor's polls (state, unlike the rest of the analysis), and
straggler_findings judges what it measured.
"""

from __future__ import annotations

import statistics
from typing import Any

from gradsync.rundir.records import GROUP_CREATIONS, Finding


class StragglerTracker:
    """How late each rank arrives at collectives, from the enter times in successive snapshots.

    The rank everyone waits for arrives last; a rank that is typically late by a good share of
    the step is a straggler (slow data loading, a throttled GPU, a noisy neighbour).
    """

    def __init__(self, ratio: float, min_s: float, max_samples: int = 4000):
        self.ratio = ratio
        self.min_s = min_s
        self.max_samples = max_samples
        self.entered: dict[tuple[str, int], dict[int, float]] = {}
        self.lateness: dict[int, list[float]] = {}
        self.starts: list[float] = []
        self.done: dict[str, int] = {}  # per group, the collectives measured so far (bounded memory)

    def observe(self, snapshots: dict[int, dict[str, Any]]) -> None:
        """Every process group counts: a rank late to its subgroup's collectives (a pipeline stage,
        a tensor-parallel group) is as much a straggler as one late on the default group."""
        members: dict[str, set[int]] = {}
        for rank, snapshot in snapshots.items():
            for group, state in snapshot.get("groups", {}).items():
                members[group] = set(state.get("ranks") or snapshots) & set(snapshots)
            for record in snapshot.get("records", []):
                if record["seq"] is None or record["seq"] <= self.done.get(record["group"], -1) or record["group"] == GROUP_CREATIONS:
                    continue  # (a group's creation waits on each rank's start-up, not on its pace)
                self.entered.setdefault((record["group"], record["seq"]), {})[rank] = record["entered"]
                members.setdefault(record["group"], set(snapshots))  # a snapshot without its groups: every rank
        for key in [k for k in self.entered if len(members.get(k[0], ())) < 2]:
            del self.entered[key]  # a group with one rank in view has no one to be late for
        complete = [key for key, times in self.entered.items() if set(times) >= members[key[0]]]
        for key in sorted(complete, key=lambda k: min(self.entered[k].values())):
            times = self.entered.pop(key)
            first = min(times.values())
            self.starts.append(first)
            for rank, entered in times.items():
                self.lateness.setdefault(rank, []).append(entered - first)
            self.done[key[0]] = max(self.done.get(key[0], -1), key[1])
        for key in [k for k in self.entered if k[1] <= self.done.get(k[0], -1)]:
            del self.entered[key]  # passed by: a rank's record of it left its window unseen
        for samples in self.lateness.values():
            del samples[: max(0, len(samples) - self.max_samples)]
        del self.starts[: max(0, len(self.starts) - self.max_samples)]

    def findings(self) -> list[Finding]:
        return straggler_findings(self.starts, self.lateness, self.ratio, self.min_s)


# Fewer measured collectives than this say nothing about a rank's typical lateness.
STRAGGLER_MIN_COLLECTIVES = 10


def straggler_findings(starts: list[float], lateness: dict[int, list[float]], ratio: float, min_s: float) -> list[Finding]:
    """The straggler finding, from what StragglerTracker measured: when each collective began
    (its first rank entered), in order, and how late each rank entered each one.

    A rank is a straggler when its typical (median) lateness exceeds `ratio` of the typical
    interval between collectives and `min_s`. When every rank is that late, the first to arrive
    changes from one collective to the next: no rank is the one the others wait for.
    """
    if len(starts) < STRAGGLER_MIN_COLLECTIVES:
        return []
    gaps = [b - a for a, b in zip(starts, starts[1:]) if b > a]
    typical_gap = statistics.median(gaps) if gaps else 0.0
    typical = {rank: statistics.median(samples) for rank, samples in lateness.items() if samples}
    limit = max(min_s, ratio * typical_gap)
    slow = sorted(rank for rank, late in typical.items() if late > limit)
    if not slow or len(slow) == len(typical):
        return []
    text = ", ".join(f"rank {r} by {typical[r] * 1000:.0f} ms" for r in slow)
    return [
        Finding(
            "straggler",
            "warning",
            slow,
            f"The other ranks typically wait for {text} at each collective (the typical interval "
            f"between collectives is {typical_gap * 1000:.0f} ms, measured over {len(starts)} collectives).",
            "Look at what only that rank does (extra logging or evaluation, slower data loading, a "
            "shared or throttled device); the whole job runs at the slowest rank's pace.",
            details={"typical_lateness_s": {str(r): round(typical[r], 4) for r in typical}},
        )
    ]
