"""Data for data-parallel training: every rank gets its own share, the same number of batches.

The loader is built on `DistributedSampler`, so each rank sees a disjoint slice of a shuffled
epoch, reshuffled every epoch from the seed. On top of it, it keeps a position (epoch and
batches consumed) that can be saved and restored: a resumed run continues with the very next
batch instead of restarting the epoch.

Ranks that had different numbers of batches would hang in the last collective of the epoch, so
the remainder of a dataset that does not divide by the world size is either padded (repeating a
few samples) or dropped, never left uneven.
"""

from __future__ import annotations

import math
import random
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from gradsync.errors import ConfigError, GradsyncError
from gradsync.profiling.capture import phase

REMAINDERS = ("pad", "drop")
_END = object()


def move_to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor nested in lists, tuples, named tuples and dicts to `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return type(batch)({k: move_to_device(v, device) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(move_to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to_device(v, device) for v in batch)
    return batch


def check_map_style(dataset: Any, world_size: int) -> int:
    """The dataset's length, after checking it can be split across `world_size` ranks."""
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise ConfigError(
            f"{type(dataset).__name__} is not a map-style dataset: gradsync's loader needs "
            "__len__ and __getitem__ to split samples across ranks (an IterableDataset must "
            "shard itself)."
        )
    size = len(dataset)
    if size < world_size:
        raise ConfigError(
            f"the dataset has {size} sample(s) but the world size is {world_size}: every rank "
            f"needs at least one sample. Use a larger dataset or at most {size} process(es)."
        )
    return size


def check_batch_size(batch_size: Any) -> None:
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size={batch_size!r}: use an integer >= 1 (per rank).")


def _batches_on_device(
    dataset: Dataset,
    index_batches: list[list[int]],
    device: torch.device,
    collate_fn: Callable[[list[Any]], Any] | None,
    num_workers: int = 0,
    generator: torch.Generator | None = None,
) -> Iterator[Any]:
    """Load the given batches of indices (in worker processes if asked) onto `device`."""
    loader = DataLoader(
        dataset,
        batch_sampler=index_batches,
        collate_fn=collate_fn,
        num_workers=num_workers,
        pin_memory=device.type == "cuda",
        worker_init_fn=_seed_worker if num_workers else None,
        generator=generator,
    )
    for batch in loader:
        yield move_to_device(batch, device)


def _seed_worker(worker_id: int) -> None:
    # torch seeds itself and `random` in each worker from the loader's generator; NumPy is left
    # identical across workers unless seeded too, which silently duplicates augmentations.
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


class DistributedLoader:
    """Batches of this rank's share of `dataset`, on the trainer's device, with a resumable position.

    `remainder="pad"` (the default) repeats up to world_size-1 samples so no sample is left
    out; `"drop"` leaves out up to world_size-1 samples so none is seen twice. Either way every
    rank gets the same number of batches. The last batch of a rank's share may be partial;
    the trainer weights it by its real sample count.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        seed: int,
        shuffle: bool = True,
        remainder: str = "pad",
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_workers: int = 0,
    ) -> None:
        check_batch_size(batch_size)
        if remainder not in REMAINDERS:
            raise ConfigError(
                f"remainder={remainder!r}: use 'pad' (repeat a few samples so none is left out) "
                "or 'drop' (leave up to world_size-1 samples out)."
            )
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ConfigError(f"num_workers={num_workers!r}: use an integer >= 0.")
        check_map_style(dataset, world_size)
        self.dataset = dataset
        self.batch_size = batch_size
        self.device = device
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.remainder = remainder
        self.sampler = DistributedSampler(
            dataset,
            num_replicas=world_size,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=remainder == "drop",
        )
        self._collate_fn = collate_fn
        self._num_workers = num_workers
        self.epoch = 0
        self.position = 0  # batches of the current epoch already handed out
        self.pass_id = 0  # counts `for batch in loader` passes, so a pass is never mistaken for another
        self._restored = False  # a loaded position waits for set_epoch of its epoch
        self._continue = False  # the next pass starts at `position`, even at the epoch's end
        # This rank's samples of an epoch resumed on another world size (None: the sampler's).
        self._redivided: list[int] | None = None
        self._redivided_from = 0  # samples of the epoch's order consumed before the re-division
        self._iterating = False
        # Called between batches, before the next is fetched: where the trainer saves checkpoints.
        self.before_batch: Callable[[], None] | None = None

    @property
    def samples_per_rank(self) -> int:
        return len(self._redivided) if self._redivided is not None else self.sampler.num_samples

    def __len__(self) -> int:
        """Batches per epoch on every rank."""
        return math.ceil(self.samples_per_rank / self.batch_size)

    def batch_size_at(self, index: int) -> int:
        """Samples in batch `index` of an epoch (the last one may be partial); equal on all ranks."""
        if not 0 <= index < len(self):
            raise IndexError(f"batch {index} is outside an epoch of {len(self)} batches")
        return min(self.batch_size, self.samples_per_rank - index * self.batch_size)

    @property
    def in_epoch(self) -> bool:
        """True while a `for batch in loader` loop is running."""
        return self._iterating

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's shuffle; starts at its first batch unless a restored position waits."""
        if self._restored and epoch == self.epoch:
            self._restored = False
            self._continue = True
            return
        self._restored = self._continue = False
        self._redivided = None
        self.epoch = epoch
        self.position = 0
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        if self.position >= len(self) and not self._continue:
            # The epoch was used up: another pass repeats it (call set_epoch for a new order).
            self.position = 0
        self._continue = False
        indices = self._redivided if self._redivided is not None else list(self.sampler)
        start = self.position * self.batch_size
        batches = [indices[i : i + self.batch_size] for i in range(start, len(indices), self.batch_size)]
        # Seeds the workers' own random streams, distinct per epoch and rank.
        generator = torch.Generator().manual_seed(self.seed + 7919 * self.epoch + self.rank)
        self.pass_id += 1
        self._iterating = True
        try:
            loaded = _batches_on_device(self.dataset, batches, self.device, self._collate_fn, self._num_workers, generator)
            while True:
                if self.before_batch is not None:
                    self.before_batch()  # before the fetch, which may draw random numbers
                with phase("data"):
                    batch = next(loaded, _END)
                if batch is _END:
                    break
                self.position += 1
                yield batch
        finally:
            self._iterating = False

    def state_dict(self) -> dict[str, int]:
        """The position to resume from: the epoch, how many of its batches were consumed, and
        how many samples of the epoch's order all ranks together consumed."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "batch_size": self.batch_size,
            "samples_per_rank": self.samples_per_rank,
            "world_size": self.world_size,
            "dataset_size": len(self.dataset),
            "epoch_start": self._epoch_start,
            "samples_consumed": self._epoch_start + min(self.position * self.batch_size, self.samples_per_rank) * self.world_size,
        }

    @property
    def _epoch_start(self) -> int:
        return self._redivided_from if self._redivided is not None else 0

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue from a saved position: the next batch is the one after the last consumed.

        Saved on another world size, the epoch goes on from the same global sample: ranks
        together consumed a prefix of the epoch's shuffled order (rank r takes every W-th
        sample), so the rest of that order is divided anew, and no sample of the epoch is
        skipped or seen twice. Later epochs are split as usual.
        """
        if state["batch_size"] != self.batch_size or state["dataset_size"] != len(self.dataset):
            raise GradsyncError(
                f"the saved loader position was taken with batch_size={state['batch_size']} over "
                f"{state['dataset_size']} samples; this loader has batch_size={self.batch_size} over "
                f"{len(self.dataset)}. Resume with the same per-rank batch size and dataset."
            )
        self.epoch = int(state["epoch"])
        self.sampler.set_epoch(self.epoch)
        self._restored = True
        self._redivided = None
        if state["world_size"] == self.world_size and state["epoch_start"] == 0:
            self.position = int(state["position"])
            return
        consumed = int(state["samples_consumed"])
        self._redivided = self._rest_of_epoch(consumed)
        self._redivided_from = consumed
        self.position = 0

    def _rest_of_epoch(self, consumed: int) -> list[int]:
        """This rank's share of the epoch's order after its first `consumed` samples."""
        whole = DistributedSampler(self.dataset, num_replicas=1, rank=0, shuffle=self.shuffle, seed=self.sampler.seed)
        whole.set_epoch(self.epoch)
        rest = list(whole)[consumed:]
        if not rest:
            return []
        if self.remainder == "drop":
            rest = rest[: len(rest) - len(rest) % self.world_size]
        else:
            padding = -len(rest) % self.world_size
            rest += (rest * math.ceil(padding / len(rest)))[:padding]
        return rest[self.rank :: self.world_size]


class EvalLoader:
    """Every sample of `dataset` exactly once across ranks (rank r takes samples r, r+W, ...).

    Under DDP, ranks may get one batch more or less than each other, which is safe because
    evaluation runs no collective per batch: evaluate with `trainer.unwrap(model)` and combine
    the counts afterwards with `trainer.sum_over_ranks`. `equal_batches` (FSDP, tensor
    parallelism: every forward is collective) gives every rank as many batches, the short
    ranks' a sample smaller, so no rank waits in a forward the others never run.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        equal_batches: bool = False,
    ) -> None:
        check_batch_size(batch_size)
        size = check_map_style(dataset, world_size)
        self.dataset = dataset
        self.device = device
        self._collate_fn = collate_fn
        indices = list(range(rank, size, world_size))
        if not equal_batches:
            self._batches = [indices[i : i + batch_size] for i in range(0, len(indices), batch_size)]
            return
        count = math.ceil(math.ceil(size / world_size) / batch_size)  # the fullest rank's batches
        if len(indices) < count:
            raise ConfigError(
                f"eval_loader(batch_size={batch_size}): {size} samples over {world_size} data-parallel ranks leave "
                f"this rank {len(indices)} samples for the {count} batches every rank must run (each forward is "
                "collective under FSDP and tensor parallelism). Use batch_size >= 2."
            )
        # Sizes differ by at most one sample, the larger batches first.
        small, extra = divmod(len(indices), count)
        bounds = [0]
        for i in range(count):
            bounds.append(bounds[-1] + small + (1 if i < extra else 0))
        self._batches = [indices[a:b] for a, b in zip(bounds, bounds[1:])]

    def __len__(self) -> int:
        return len(self._batches)

    def __iter__(self) -> Iterator[Any]:
        return _batches_on_device(self.dataset, self._batches, self.device, self._collate_fn)
