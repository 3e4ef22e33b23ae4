"""Hand-rolled Accelerate-style evaluation on 2 ranks: after a short DDP training run of
a token tagger on synthetic variable-length sequences, each rank runs its shard of the
validation set, collects the predicted tags of every sequence, gathers predictions and
labels from all ranks with a small gather() helper, and rank 0 reports token accuracy."""
import datetime

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Accel:
    def __init__(self):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.is_main_process = self.rank == 0

    def gather(self, t):
        out = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(out, t)
        return torch.cat(out)


def sequences(n, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(5, 20, (1,), generator=g))
        x = torch.randn(length, 8, generator=g)
        out.append((x, (x[:, 0] > 0).long()))
    return out


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    acc = Accel()
    run(acc)
    dist.barrier()
    dist.destroy_process_group()


def run(acc):
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for x, y in sequences(40, 1)[acc.rank::acc.world]:
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    preds, labels = [], []
    with torch.no_grad():
        for x, y in sequences(10, 2)[acc.rank::acc.world]:
            p = model.module(x).argmax(dim=-1)
            preds.append(acc.gather(p))
            labels.append(acc.gather(y))
    if acc.is_main_process:
        p, l = torch.cat(preds), torch.cat(labels)
        print(f"token accuracy {(p == l).float().mean().item():.3f} over {len(l)} tokens", flush=True)


if __name__ == "__main__":
    main()
