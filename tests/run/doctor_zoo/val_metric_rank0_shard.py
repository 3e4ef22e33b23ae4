"""Validation accuracy from rank 0's shard only, used to pick the best checkpoint.

Intent: validation is sharded with DistributedSampler to make it faster;
after each half-epoch rank 0 logs "val acc" and saves the model when it beats
the best so far.

What goes wrong: `correct` and `total` are never reduced across ranks. Each
rank computes accuracy on its own half of the validation set, so the number
rank 0 logs (and the best-checkpoint decision it drives) reflects only 50% of
the validation data; rank 1 holds a different value for the same model. The
training itself is correct (replicas stay identical); the reported metric and
the model selection are wrong.

Public report: https://github.com/pytorch/examples/issues/905 ("the `validate`
function will return different values for each process when using DDP. The
results should be combined across all GPUs").

Expected verdict (ideal checker): the validation metric differs by rank at
every evaluation (rank 0 vs rank 1 accuracy printed), it is not all-reduced
before being logged/used; parameters identical across ranks. Cause: the
`acc = correct / total` line marked with the zoo cause marker.

Plain torchrun (measured, `torchrun --standalone --nproc-per-node 2`, CPU,
gloo): exit 0, 32 steps/rank, ~9-19 s. val acc at steps 8/16/24/32: rank 0 =
0.44/0.56/0.61/0.70, rank 1 = 0.58/0.65/0.67/0.72; rank 0's 'best' = 0.70;
parameter checksum -3.38380065 on both ranks.
"""
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def make_split(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 10, generator=g)
    y = ((x[:, 0] + 0.7 * x[:, 1] + 0.5 * torch.randn(n, generator=g)) > 0).long()
    return TensorDataset(x, y)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    train, val = make_split(512, 1), make_split(200, 2)
    sampler = DistributedSampler(train, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=16, sampler=sampler)
    val_loader = DataLoader(val, batch_size=50, sampler=DistributedSampler(val, shuffle=False))
    best_path = os.path.join(tempfile.gettempdir(), f"redteam42_best_{os.environ.get('MASTER_PORT', '0')}.pt")

    best, step = 0.0, 0
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step % 8 == 0:
                model.eval()
                correct = total = 0
                with torch.no_grad():
                    for vx, vy in val_loader:
                        correct += (model(vx).argmax(1) == vy).sum().item()
                        total += len(vy)
                model.train()
                acc = correct / total  # doctor: cause
                print(f"[rank {rank}] step {step} val acc {acc:.4f}", flush=True)
                if rank == 0 and acc > best:
                    best = acc
                    torch.save(model.module.state_dict(), best_path)

    cs = sum(p.detach().double().sum().item() for p in model.parameters())
    print(f"[rank {rank}] best {best:.4f} final param checksum {cs:.8f}", flush=True)
    dist.barrier()
    if rank == 0 and os.path.exists(best_path):
        os.remove(best_path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
