"""Object collectives with wildly different payload sizes per rank. HEALTHY.

Mechanism (h): each rank builds a local vocabulary (rank 1's is ~40x bigger
when pickled), merges them with all_gather_object, sends a report to rank 0
with gather_object, and rank 0 broadcasts the merged config with
broadcast_object_list (same list length everywhere). Different object sizes
are legal: all_gather_object first gathers the sizes and pads to the maximum,
so the byte tensors inside agree. Exit code 0 on both ranks.

Drawn from: https://github.com/PaddlePaddle/Paddle/pull/44718 ("Fix
all_gather_object to support various length object": sizes must be exchanged
first, as torch does) and https://github.com/pytorch/pytorch/pull/42189
(torch's object all-gather: "Comm. tensor sizes ... Copy local ByteTensor into
a tensor of maximal size").
"""
import collections
import os
import random

import torch.distributed as dist

dist.init_process_group("gloo")
RANK, WORLD = dist.get_rank(), dist.get_world_size()
rng = random.Random(RANK)


def local_vocab():
    n_docs = 20 if RANK == 0 else 800
    counter = collections.Counter()
    for _ in range(n_docs):
        n_types = 60 if RANK == 0 else 3000
        doc = ["tok%d_%d" % (rng.randrange(n_types), RANK) for _ in range(12)]
        counter.update(doc)
    return dict(counter)


vocab = local_vocab()
merged_parts = [None] * WORLD
dist.all_gather_object(merged_parts, vocab)  # zoo: ragged-gather
merged = collections.Counter()
for part in merged_parts:
    merged.update(part)

report = {"rank": RANK, "local_types": len(vocab), "tokens": sum(vocab.values())}
reports = [None] * WORLD if RANK == 0 else None
dist.gather_object(report, reports, dst=0)  # zoo: gather-obj

config = [None, None]
if RANK == 0:
    config = [sorted(merged)[:5], {"vocab_size": len(merged), "reports": reports}]
dist.broadcast_object_list(config, src=0)  # zoo: bcast-obj
assert config[1]["vocab_size"] == len(merged)
print(f"rank {RANK}: merged vocab {len(merged)} types; first {config[0][:2]}", flush=True)
dist.barrier()
dist.destroy_process_group()
