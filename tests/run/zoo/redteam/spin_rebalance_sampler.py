"""DDP; at epoch 2 rank 0 rebalances its shard and spins forever in a helper.

Mechanism (b), BROKEN (hangs forever). The spinning loop lives in another file
(rtlib/balanced.py, `while len(picked) < ...`). Rank 0's quality filter removed
every class-3 sample from its shard, so the per-class quota can never be
filled. Rank 1 rebalances fine and waits in DDP's gradient all-reduce
(loss.backward()) of the first step of epoch 2.

Drawn from: https://github.com/underworldcode/underworld3/pull/630 (one rank
somewhere else while the others wait together in the collective) and
https://github.com/ptycho/ptypy/issues/108 (hang at 100 % CPU, no output).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from rtlib.balanced import pick_balanced  # noqa: E402

CLASSES = (0, 1, 2, 3)


def make_shard(rank, n=400):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(n, 10, generator=g)
    y = torch.randint(0, 4, (n,), generator=g)
    quality = torch.rand(n, generator=g)
    if rank == 0:
        quality[y == 3] = 0.0  # rank 0's camera never rated class 3 highly
    keep = quality > 0.2
    return x[keep], y[keep]


def epochs(model, x, y, rank):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    order = list(range(len(y)))
    for epoch in range(3):
        if epoch >= 1:
            order = pick_balanced(y.tolist(), per_class=20, classes=CLASSES, seed=epoch)
        for s in range(0, 80, 16):
            idx = torch.tensor(order[s:s + 16])
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()  # zoo: peer-wait
            opt.step()
        print(f"[{rank}] epoch {epoch} loss {loss.item():.3f}", flush=True)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    r = int(os.environ["RANK"])
    torch.manual_seed(0)
    net = DDP(nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4)))
    xs, ys = make_shard(r)
    epochs(net, xs, ys, r)
    dist.destroy_process_group()
