"""Reproducible random streams for Python, NumPy and torch."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python's `random`, NumPy's global generator and torch (CPU and every GPU)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rank_seed(seed: int, rank: int) -> int:
    """A seed for `rank`'s own stream, well mixed so that seeds of nearby ranks do not correlate."""
    return int(np.random.SeedSequence([seed, rank]).generate_state(1)[0])


def rng_state() -> dict:
    """Every random stream of this process (Python, NumPy, torch CPU and each GPU), for a checkpoint."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
    }


def set_rng_state(state: dict) -> None:
    """Continue the streams `rng_state` captured, so a resumed run draws what the original would."""
    random.setstate(_as_tuples(state["python"]))
    np.random.set_state(_as_tuples(state["numpy"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuples(value):
    # random.setstate insists on tuples all the way down.
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value
