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
