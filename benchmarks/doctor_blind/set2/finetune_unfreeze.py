import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

EPOCHS = 2
BATCH_SIZE = 32
UNFREEZE_AFTER = 8  # optimizer steps with the backbone frozen (head warm-up)


def make_dataset(n=2048, dim=24, classes=6):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, dim, generator=g)
    w1 = torch.randn(dim, 48, generator=g)
    w2 = torch.randn(48, classes, generator=g)
    y = (torch.relu(x @ w1) @ w2).argmax(dim=1)
    return TensorDataset(x, y)


class Classifier(nn.Module):
    def __init__(self, dim=24, hidden=64, classes=6):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.head(self.backbone(x))


def set_backbone_trainable(model, trainable):
    for p in model.backbone.parameters():
        p.requires_grad_(trainable)


def train(rank, world_size):
    torch.manual_seed(0)
    net = Classifier()
    set_backbone_trainable(net, False)
    model = DDP(net)
    optimizer = torch.optim.SGD(
        [
            {"params": net.backbone.parameters(), "lr": 0.02},
            {"params": net.head.parameters(), "lr": 0.1},
        ],
        momentum=0.9,
    )

    dataset = make_dataset()
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler)

    step = 0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in loader:
            if step == UNFREEZE_AFTER:
                set_backbone_trainable(net, True)
                if rank == 0:
                    print(f"step {step}: backbone unfrozen")
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            step += 1
            if rank == 0 and step % 16 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}")


def main():
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    train(rank, world_size)
    dist.destroy_process_group()
    time.sleep(0.5)


if __name__ == "__main__":
    main()
