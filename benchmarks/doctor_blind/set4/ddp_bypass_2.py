import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class Classifier(nn.Module):
    def __init__(self, d_in=24, d_feat=32, n_classes=6):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(d_in, 64), nn.ReLU(), nn.Linear(64, d_feat), nn.ReLU())
        self.head = nn.Linear(d_feat, n_classes)

    def encode(self, x):
        return self.backbone(x)

    def classify(self, feats):
        return self.head(feats)

    def forward(self, x, return_feats=False):
        feats = self.encode(x)
        logits = self.classify(feats)
        if return_feats:
            return logits, feats
        return logits


def make_split(n, seed):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(6, 24, generator=torch.Generator().manual_seed(99)) * 1.5
    y = torch.randint(0, 6, (n,), generator=g)
    x = centers[y] + torch.randn(n, 24, generator=g)
    return TensorDataset(x, y)


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    torch.manual_seed(0)

    train_ds = make_split(768, seed=1)
    val_ds = make_split(256, seed=2)
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(train_ds, batch_size=32, sampler=sampler, drop_last=True)

    model = DDP(Classifier())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    feat_reg = 1e-3

    for epoch in range(4):
        sampler.set_epoch(epoch)
        model.train()
        for step, (x, y) in enumerate(loader):
            logits, feats = model(x, return_feats=True)
            loss = F.cross_entropy(logits, y) + feat_reg * feats.pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            acc = (model.module(val_ds.tensors[0]).argmax(1) == val_ds.tensors[1]).float().mean().item()
        if rank == 0:
            print(f"epoch {epoch} last loss {loss.item():.4f} val acc {acc:.3f}", flush=True)

    dist.barrier()
    dist.destroy_process_group()
    time.sleep(1)


if __name__ == "__main__":
    main()
