"""Character-level LM warm-up with DDP. Records are packed into fixed-length
rows with ctypes to avoid Python-level copies."""
import ctypes
import datetime

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

SEQ = 24
CORPUS = [
    "the quick brown fox", "jumps over the lazy dog", "pack my box with",
    "five dozen liquor jugs", "how vexingly quick", "daft zebras jump",
    "sphinx of black quartz", "judge my vow", "a wizard's job is to",
    "vex chumps quickly", "the five boxing wizards", "", "jump quickly",
    "bright vixens jump", "dozy fowl quack", "waltz bad nymph",
]


def as_buffer(text):
    if not text:
        return None
    return ctypes.create_string_buffer(text.encode()[:SEQ], SEQ)


def pack(records):
    out = ctypes.create_string_buffer(SEQ * len(records))
    base = ctypes.addressof(out)
    for i, rec in enumerate(records):
        ctypes.memmove(base + i * SEQ, as_buffer(rec), SEQ)
    return torch.frombuffer(bytearray(out.raw), dtype=torch.uint8).view(len(records), SEQ).long()


class CharLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(256, 32)
        self.out = nn.Linear(32, 256)

    def forward(self, x):
        return self.out(self.emb(x))


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = CORPUS[rank::world]
    model = DDP(CharLM())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(0, len(shard), 2):
        rows = pack(shard[step:step + 2])
        logits = model(rows[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 256), rows[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"rank {rank} step {step // 2} loss {loss.item():.3f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
