import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

UNFREEZE_EPOCH = 1
EPOCHS = 4


class FineTuneNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Linear(16, 64), nn.ReLU(),
            nn.Linear(64, 64), nn.ReLU(),
        )
        self.head = nn.Linear(64, 3)

    def forward(self, x):
        return self.head(self.backbone(x))


def make_data(n=768, seed=21):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    proj = torch.randn(16, 3, generator=g)
    y = torch.bucketize((x @ proj).sum(1), torch.tensor([-1.5, 1.5]))
    return TensorDataset(x, y)


def set_backbone_trainable(net, flag):
    for p in net.backbone.parameters():
        p.requires_grad = flag


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    torch.manual_seed(0)

    data = make_data()
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(data, batch_size=32, sampler=sampler, drop_last=True)

    net = FineTuneNet()
    set_backbone_trainable(net, False)
    model = DDP(net)

    optimizer = torch.optim.AdamW(
        [
            {"params": net.head.parameters(), "lr": 3e-3},
            {"params": net.backbone.parameters(), "lr": 1e-3},
        ],
        weight_decay=0.01,
    )

    for epoch in range(EPOCHS):
        if epoch == UNFREEZE_EPOCH:
            set_backbone_trainable(net, True)
            del model
            model = DDP(net)
            if rank == 0:
                print("unfreezing backbone", flush=True)
        sampler.set_epoch(epoch)
        model.train()
        tot = 0.0
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            tot += loss.item()
        if rank == 0:
            print(f"epoch {epoch} mean loss {tot / len(loader):.4f}", flush=True)

    dist.barrier()
    dist.destroy_process_group()
    time.sleep(1)


if __name__ == "__main__":
    main()
