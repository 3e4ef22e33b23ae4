import copy
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
EMA_DECAY = 0.99
CONSISTENCY_WEIGHT = 2.0
SEED = 7


def make_semi_supervised(n=2048, dim=20, classes=5, labeled_frac=0.25):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, classes, generator=g)
    y = (x @ w).argmax(dim=1)
    labeled = torch.rand(n, generator=g) < labeled_frac
    y = torch.where(labeled, y, torch.full_like(y, -1))
    return TensorDataset(x, y)


def build_model():
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5))


def augment(x):
    return x + 0.1 * torch.randn_like(x)


@torch.no_grad()
def ema_update(teacher, student, decay):
    for t, s in zip(teacher.parameters(), student.parameters()):
        t.mul_(decay).add_(s.detach(), alpha=1 - decay)


def train(rank, world_size):
    torch.manual_seed(SEED + rank)
    model = DDP(build_model())
    teacher = copy.deepcopy(model.module)
    for p in teacher.parameters():
        p.requires_grad_(False)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    dataset = make_semi_supervised()
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=SEED)
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler)

    step = 0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in loader:
            logits = model(augment(x))
            with torch.no_grad():
                teacher_probs = teacher(augment(x)).softmax(dim=1)
            labeled = y >= 0
            sup = F.cross_entropy(logits[labeled], y[labeled]) if labeled.any() else logits.sum() * 0
            cons = F.mse_loss(logits.softmax(dim=1), teacher_probs)
            loss = sup + CONSISTENCY_WEIGHT * cons
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ema_update(teacher, model.module, EMA_DECAY)
            step += 1
            if rank == 0 and step % 16 == 0:
                print(f"epoch {epoch} step {step} sup {sup.item():.4f} cons {cons.item():.5f}")


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
