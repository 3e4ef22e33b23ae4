"""Token-level tagging with DDP. Padding positions carry the ignore label;
batches with no supervised token are skipped."""
import datetime

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

IGNORE = -100


def make_batches(rank, n=10):
    g = torch.Generator().manual_seed(rank)
    out = []
    for i in range(n):
        tokens = torch.randint(1, 50, (4, 12), generator=g)
        tags = torch.randint(0, 3, (4, 12), generator=g)
        keep = torch.rand(4, 12, generator=g) < (0.0 if (rank == 1 and i == 2) else 0.6)
        out.append((tokens, torch.where(keep, tags, torch.full_like(tags, IGNORE))))
    return out


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, tokens):
        return self.head(self.emb(tokens))


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(Tagger())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step, (tokens, tags) in enumerate(make_batches(rank)):
        if (tags != IGNORE).sum() == 0:
            continue
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.view(-1, 3), tags.view(-1), ignore_index=IGNORE)
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"rank {rank} finished, last loss {loss.item():.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
