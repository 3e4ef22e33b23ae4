"""DDP text-classification warm-up. Each rank tokenizes its own shard with a
multiprocessing pool before training."""
import datetime
import multiprocessing as mp
import sys

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

VOCAB = {w: i + 1 for i, w in enumerate("a an the cat dog bird runs sits flies sleeps on mat tree sky".split())}
LINES = [
    "1\tthe cat sits on the mat", "0\ta bird flies", "1\tthe dog runs",
    "0\tan bird sleeps on the tree", "1\tthe cat runs", "0\tthe bird flies on the sky",
    "1\ta dog sits", "0\tthe bird sleeps", "1\tthe cat sleeps on the mat",
    "0\ta bird sits on the tree", "1\tthe dog sleeps", "the cat flies",
    "1\ta cat sits", "0\tthe bird runs on the sky", "1\tthe dog sits on the mat",
    "0\tan bird flies on the tree",
]


def die(msg):
    print(f"error: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


def parse(line, max_len=8):
    parts = line.split("\t")
    if len(parts) != 2:
        die(f"malformed line: {line!r}")
    label, text = parts
    ids = [VOCAB.get(w, 0) for w in text.split()][:max_len]
    return int(label), ids + [0] * (max_len - len(ids))


def tokenize(lines, workers=2):
    with mp.Pool(workers) as pool:
        rows = pool.map(parse, lines, chunksize=2)
    labels = torch.tensor([r[0] for r in rows])
    ids = torch.tensor([r[1] for r in rows])
    return ids, labels


class BagOfWords(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(len(VOCAB) + 1, 16)
        self.fc = nn.Linear(16, 2)

    def forward(self, ids):
        return self.fc(self.emb(ids))


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    ids, labels = tokenize(LINES[rank::world])
    model = DDP(BagOfWords())
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for epoch in range(5):
        loss = nn.functional.cross_entropy(model(ids), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"rank {rank} loss {loss.item():.3f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
