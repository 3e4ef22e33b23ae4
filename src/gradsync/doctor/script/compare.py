"""How the checks' rules compare ranks and say which: the odd ones out, and ranks in words."""

from __future__ import annotations

from typing import Any

NAMES_SHOWN = 5  # differing parameter or buffer names spelled out in a message


def ranks_text(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in sorted(ranks))


def odd_ones_out(values: dict[int, Any]) -> list[int]:
    """The ranks outside the one largest group of equal values; every rank when no group is largest."""
    groups: dict[Any, list[int]] = {}
    for rank, value in values.items():
        groups.setdefault(value, []).append(rank)
    sizes = sorted((len(ranks) for ranks in groups.values()), reverse=True)
    if len(sizes) > 1 and sizes[0] > sizes[1]:
        largest = max(groups.values(), key=len)
        return sorted(r for r in values if r not in largest)
    return sorted(values)


def names_text(names: list[str]) -> str:
    shown = ", ".join(names[:NAMES_SHOWN])
    return shown + (f" and {len(names) - NAMES_SHOWN} more" if len(names) > NAMES_SHOWN else "")


def settings_differ(hyper: dict[int, str]) -> str:
    """'lr: rank 0 0.025, rank 1 0.05' for the settings that differ (the text: groups ' | ', items '; ')."""
    parsed = {rank: [dict(item.split("=", 1) for item in group.split("; ") if "=" in item) for group in text.split(" | ")]
              for rank, text in hyper.items()}
    parts = []
    for index in range(min(len(groups) for groups in parsed.values())):
        keys = sorted(set().union(*(groups[index] for groups in parsed.values())))
        for key in keys:
            values = {rank: groups[index].get(key, "-") for rank, groups in parsed.items()}
            if len(set(values.values())) > 1:
                group = f" (group {index})" if len(next(iter(parsed.values()))) > 1 else ""
                parts.append(f"{key}{group}: " + ", ".join(f"rank {r} {v}" for r, v in sorted(values.items())))
    return "; ".join(parts[:4]) or "their settings"
