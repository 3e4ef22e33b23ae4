import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

MAX_LEN = 24
N_CLASSES = 4
D_IN = 8


class VarLenTagging(Dataset):
    """Synthetic sequence tagging task with variable-length, right-padded sequences."""

    def __init__(self, n=512, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(2, MAX_LEN + 1, (n,), generator=g)
        self.x = torch.randn(n, MAX_LEN, D_IN, generator=g)
        w = torch.randn(D_IN, N_CLASSES, generator=g)
        ctx = self.x.mean(1, keepdim=True)
        self.y = ((self.x + 0.5 * ctx) @ w).argmax(-1)
        self.mask = torch.arange(MAX_LEN)[None, :] < self.lengths[:, None]

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return self.x[i], self.y[i], self.mask[i]


class Tagger(nn.Module):
    def __init__(self, d=48):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(D_IN, d), nn.ReLU(), nn.Linear(d, d), nn.ReLU())
        self.head = nn.Linear(2 * d, N_CLASSES)

    def forward(self, x, mask):
        h = self.enc(x)
        m = mask.unsqueeze(-1).float()
        ctx = (h * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1)
        return self.head(torch.cat([h, ctx.expand_as(h)], dim=-1))


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    torch.manual_seed(0)

    ds = VarLenTagging()
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(ds, batch_size=8, sampler=sampler, drop_last=True)

    model = DDP(Tagger())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    step = 0
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y, mask in loader:
            logits = model(x, mask)
            token_loss = F.cross_entropy(logits.reshape(-1, N_CLASSES), y.reshape(-1), reduction="none")
            token_loss = token_loss * mask.reshape(-1).float()
            num_tokens = mask.sum()
            global_tokens = num_tokens.clone()
            dist.all_reduce(global_tokens, op=dist.ReduceOp.SUM)
            loss = token_loss.sum() * world_size / global_tokens
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if rank == 0 and step % 16 == 0:
                print(f"step {step} token loss {loss.item():.4f} tokens {num_tokens.item()}", flush=True)

    dist.barrier()
    dist.destroy_process_group()
    time.sleep(1)


if __name__ == "__main__":
    main()
