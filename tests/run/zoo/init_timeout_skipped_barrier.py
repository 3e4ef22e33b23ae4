"""`init_process_group("gloo", timeout=timedelta(seconds=4))` and "main process first" done
wrong: rank 0 prepares the shared vocabulary file, then calls `dist.barrier()` to release the
others, but the matching barrier on the other ranks was left out. Rank 1 goes straight on to
tokenizing its shard (up to 30 s of CPU, outside any collective), so rank 0's barrier gives up
after 4 s with Gloo's timeout error and the launcher stops rank 1 mid-tokenizing. The rank that
raised only waited; rank 1, which never came to the barrier, is the one to look at."""

import argparse
import os
import tempfile
import time
from collections import Counter
from datetime import timedelta

import torch
import torch.distributed as dist

WORDS = "the quick brown fox jumps over the lazy dog while the model trains on every rank".split()


def tokenize(rank: int, seconds: float) -> Counter:
    """Stands in for tokenizing this rank's shard: about `seconds` of pure CPU work."""
    shard = " ".join(WORDS[(i * (rank + 3)) % len(WORDS)] for i in range(20000))
    counts: Counter = Counter()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        counts.update(word.lower() for word in shard.split())  # zoo: tokenize
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokenize-seconds", type=float, default=30.0)  # far beyond the 4 s, even on a loaded machine
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=4))
    rank = int(os.environ["RANK"])
    vocab_path = os.path.join(tempfile.gettempdir(), "zoo_init_timeout_vocab.txt")
    if rank == 0:
        with open(vocab_path, "w") as f:
            f.write("\n".join(sorted(set(WORDS))))
        dist.barrier()  # zoo: barrier
    # BUG: the other ranks were to wait for the file here too (`else: dist.barrier()`).
    counts = tokenize(rank, args.tokenize_seconds)  # zoo: tokenize_call
    total = torch.tensor([float(sum(counts.values()))])
    dist.all_reduce(total)  # zoo: all_reduce
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
