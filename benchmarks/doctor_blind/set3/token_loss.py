"""Tiny next-token (bigram) language model trained with DDP on padded variable-length sequences; each rank reads its own data shard."""
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

VOCAB, PAD, MAX_LEN = 40, 0, 32


def load_shard(rank, n_seqs=320):
    """Shard 0 holds short utterances, shard 1 holds long documents."""
    g = torch.Generator().manual_seed(90 + rank)
    lo, hi = (4, 10) if rank % 2 == 0 else (20, MAX_LEN)
    lengths = torch.randint(lo, hi + 1, (n_seqs,), generator=g)
    seqs = torch.full((n_seqs, MAX_LEN), PAD, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        start = torch.randint(1, VOCAB, (1,), generator=g).item()
        steps = torch.randint(1, 4, (n,), generator=g)
        seqs[i, :n] = (start + torch.cumsum(steps, 0)) % (VOCAB - 1) + 1
    return seqs


class Bigram(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32, padding_idx=PAD)
        self.out = nn.Sequential(nn.ReLU(), nn.Linear(32, VOCAB))

    def forward(self, tokens):
        return self.out(self.emb(tokens))


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    torch.manual_seed(0)

    shard = load_shard(rank)
    model = DDP(Bigram())
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)

    batch_size = 16
    for step in range(shard.shape[0] // batch_size):
        batch = shard[step * batch_size:(step + 1) * batch_size]
        inputs, targets = batch[:, :-1], batch[:, 1:]
        mask = (targets != PAD).float()
        logits = model(inputs)
        token_loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="none")
        loss = (token_loss * mask.reshape(-1)).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 5 == 0:
            print(f"rank {rank} step {step} loss {loss.item():.4f} tokens {int(mask.sum())}")

    dist.barrier()
    dist.destroy_process_group()
    time.sleep(1)


if __name__ == "__main__":
    main()
