"""Class-balanced subsampling helper (imported by spin_rebalance_sampler.py)."""
import random


def pick_balanced(labels, per_class, classes, seed=0):
    """Draw `per_class` indices of every class in `classes` at random.

    Bug: if one class is absent from `labels`, the quota can never be met and
    the loop spins forever (pure Python, 100 % of one core).
    """
    rng = random.Random(seed)
    quota = {c: per_class for c in classes}
    picked = []
    seen = set()
    while len(picked) < per_class * len(classes):  # zoo: spin
        i = rng.randrange(len(labels))
        c = labels[i]
        if quota.get(c, 0) > 0 and i not in seen:
            quota[c] -= 1
            seen.add(i)
            picked.append(i)
    return picked
