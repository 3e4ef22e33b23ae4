"""The distributed loader: even batches on every rank, coverage, shuffling, resumable position.

Ranks are simulated in one process: the sampler takes rank and world size explicitly, so these
checks need no process group.
"""

import itertools

import pytest
import torch
from torch.utils.data import IterableDataset, TensorDataset

from gradsync import ConfigError, GradsyncError
from gradsync.data import DistributedLoader, EvalLoader


def indexed(n):
    return TensorDataset(torch.arange(n))


def loaders(n, world_size, **options):
    options.setdefault("batch_size", 4)
    return [
        DistributedLoader(indexed(n), rank=r, world_size=world_size, device=torch.device("cpu"), seed=3, **options)
        for r in range(world_size)
    ]


def epoch_samples(loader):
    return [batch[0].tolist() for batch in loader]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [4, 17, 40, 41])
@pytest.mark.parametrize("remainder", ["pad", "drop"])
def test_every_rank_gets_the_same_number_of_batches(world_size, n, remainder):
    ranks = loaders(n, world_size, remainder=remainder)
    batches = [epoch_samples(loader) for loader in ranks]
    counts = {len(b) for b in batches}
    assert counts == {len(ranks[0])}, f"uneven batches {[len(b) for b in batches]} would hang DDP"
    sizes = [[len(batch) for batch in b] for b in batches]
    assert all(s == sizes[0] for s in sizes), "batch sizes must match too (equal weights across ranks)"
    assert sizes[0] == [ranks[0].batch_size_at(i) for i in range(len(ranks[0]))]
    seen = [i for b in batches for batch in b for i in batch]
    if remainder == "pad":
        assert set(seen) == set(range(n)), "padding must leave no sample out"
        assert len(seen) - n < world_size
    else:
        assert len(seen) == len(set(seen)), "dropping must not repeat a sample"
        assert n - len(seen) < world_size


def test_ranks_see_disjoint_shares_that_reshuffle_every_epoch():
    ranks = loaders(40, 2)
    first = [epoch_samples(loader) for loader in ranks]
    assert not set(itertools.chain(*first[0])) & set(itertools.chain(*first[1]))
    for loader in ranks:
        loader.set_epoch(1)
    second = [epoch_samples(loader) for loader in ranks]
    assert first[0] != second[0], "set_epoch must change the order"
    again = loaders(40, 2)
    assert [epoch_samples(loader) for loader in again] == first, "same seed, same order"


def test_a_restored_position_continues_with_the_next_batch():
    original = loaders(50, 2, batch_size=3)[1]
    original.set_epoch(2)
    full = epoch_samples(original)
    original.set_epoch(2)
    taken = list(itertools.islice(iter(original), 5))
    state = original.state_dict()
    assert state["epoch"] == 2 and state["position"] == 5

    resumed = loaders(50, 2, batch_size=3)[1]
    resumed.load_state_dict(state)
    resumed.set_epoch(2)  # what the trainer's epoch loop calls: must not rewind
    rest = epoch_samples(resumed)
    assert [b[0].tolist() for b in taken] + rest == full
    resumed.set_epoch(3)
    assert resumed.position == 0 and len(epoch_samples(resumed)) == len(resumed)


def test_restoring_into_a_different_layout_is_refused():
    state = loaders(50, 2, batch_size=3)[0].state_dict()
    with pytest.raises(GradsyncError, match="same per-rank batch size and dataset"):
        loaders(50, 2, batch_size=4)[0].load_state_dict(state)
    with pytest.raises(GradsyncError, match="over 50 samples; this loader has batch_size=3 over 51"):
        loaders(51, 2, batch_size=3)[0].load_state_dict(state)


@pytest.mark.parametrize("remainder", ["pad", "drop"])
@pytest.mark.parametrize("before, after", [(2, 3), (3, 2), (4, 1), (2, 2)])
def test_another_world_size_goes_on_from_the_same_global_sample(before, after, remainder):
    """Ranks together consumed a prefix of the epoch's order; the rest is divided anew, twice over."""
    size = 61
    old = loaders(size, before, batch_size=3, remainder=remainder)
    consumed_batches = 4
    taken = []
    for loader in old:
        loader.set_epoch(1)
        taken += [i for b in itertools.islice(iter(loader), consumed_batches) for i in b[0].tolist()]
    state = old[0].state_dict()
    assert state["samples_consumed"] == consumed_batches * 3 * before

    middle = loaders(size, after, batch_size=3, remainder=remainder)
    seen = []
    for loader in middle:
        loader.load_state_dict(state)
        loader.set_epoch(1)
        seen += [i for b in itertools.islice(iter(loader), 2) for i in b[0].tolist()]
    state = middle[0].state_dict()
    newest = loaders(size, before, batch_size=3, remainder=remainder)  # and back again
    for loader in newest:
        loader.load_state_dict(state)
        loader.set_epoch(1)
        seen += [i for batch in epoch_samples(loader) for i in batch]
    everything = taken + seen
    if remainder == "pad":  # every sample at least once; repeats only to even out the last split
        assert set(everything) == set(range(size)) and len(everything) - size < before + after
    else:  # no sample twice; a few left out only to even out a split
        assert len(set(everything)) == len(everything) and size - len(everything) < before + after
    if before == after:
        assert sorted(everything) == sorted(i for loader in loaders(size, before, batch_size=3, remainder=remainder)
                                            for i in _epoch_one(loader))
    for loader in newest:
        loader.set_epoch(2)
        assert len(loader) == len(loaders(size, before, batch_size=3, remainder=remainder)[0])


def _epoch_one(loader):
    loader.set_epoch(1)
    return [i for batch in epoch_samples(loader) for i in batch]


def test_loader_errors_say_what_to_change():
    with pytest.raises(ConfigError, match="the dataset has 2 sample"):
        loaders(2, 3)
    with pytest.raises(ConfigError, match="batch_size=0"):
        loaders(10, 1, batch_size=0)
    with pytest.raises(ConfigError, match="remainder='even'"):
        loaders(10, 1, remainder="even")

    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(3)

    with pytest.raises(ConfigError, match="not a map-style dataset"):
        DistributedLoader(Stream(), 2, rank=0, world_size=1, device=torch.device("cpu"), seed=0)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_eval_loader_sees_every_sample_exactly_once(world_size):
    seen = []
    for rank in range(world_size):
        for (batch,) in EvalLoader(indexed(23), 4, rank=rank, world_size=world_size, device=torch.device("cpu")):
            seen += batch.tolist()
    assert sorted(seen) == list(range(23))


@pytest.mark.launches
def test_worker_processes_load_the_same_batches():
    in_process = loaders(30, 2, batch_size=4)[1]
    with_workers = loaders(30, 2, batch_size=4, num_workers=2)[1]
    assert epoch_samples(with_workers) == epoch_samples(in_process)
