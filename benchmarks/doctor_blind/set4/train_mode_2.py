import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

EVAL_EVERY = 5


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.3),
            nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.3),
            nn.Linear(64, 4),
        )

    def forward(self, x):
        return self.layers(x)


def make_split(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = 3.0 * torch.randn(n, 16, generator=g) + 1.0
    y = ((x[:, 0] > 1.0).long() + 2 * (x[:, 1] + x[:, 2] > 2.0).long())
    return TensorDataset(x, y)


@torch.no_grad()
def validate(net, val_ds):
    was_training = net.training
    net.eval()
    x, y = val_ds.tensors
    logits = net(x)
    net.train(was_training)
    return F.cross_entropy(logits, y).item(), (logits.argmax(1) == y).float().mean().item()


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    torch.manual_seed(rank)

    train_ds, val_ds = make_split(768, 1), make_split(200, 2)
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train_ds, batch_size=32, sampler=sampler, drop_last=True)

    model = DDP(BNNet())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)

    global_step = 0
    for epoch in range(4):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            global_step += 1
            if rank == 0 and global_step % EVAL_EVERY == 0:
                val_loss, val_acc = validate(model.module, val_ds)
                print(f"step {global_step} train {loss.item():.4f} val {val_loss:.4f} acc {val_acc:.3f}", flush=True)

    dist.barrier()
    dist.destroy_process_group()
    time.sleep(1)


if __name__ == "__main__":
    main()
