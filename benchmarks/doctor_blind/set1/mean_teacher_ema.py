"""Self-distillation with an EMA teacher (BYOL-like), teacher kept in sync on every rank."""
import argparse
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


def make_data(n=2048, dim=48, clusters=32, seed=13):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(clusters, dim, generator=g) * 2
    idx = torch.randint(0, clusters, (n,), generator=g)
    return TensorDataset(centers[idx] + 0.3 * torch.randn(n, dim, generator=g))


def augment(x):
    return x * (torch.rand_like(x) > 0.2).float() + 0.1 * torch.randn_like(x)


class Student(nn.Module):
    def __init__(self, dim=48, hidden=128, proj=32):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden))
        self.projector = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, proj))
        self.predictor = nn.Sequential(nn.Linear(proj, hidden), nn.ReLU(), nn.Linear(hidden, proj))

    def embed(self, x):
        return self.projector(self.encoder(x))

    def forward(self, x):
        return self.predictor(self.embed(x))


class EMATeacher:
    def __init__(self, student, decay):
        self.encoder = copy.deepcopy(student.encoder).requires_grad_(False)
        self.projector = copy.deepcopy(student.projector).requires_grad_(False)
        self.decay = decay

    @torch.no_grad()
    def __call__(self, x):
        return self.projector(self.encoder(x))

    @torch.no_grad()
    def update(self, student):
        pairs = list(zip(self.encoder.parameters(), student.encoder.parameters()))
        pairs += list(zip(self.projector.parameters(), student.projector.parameters()))
        for t, s in pairs:
            t.lerp_(s.detach(), 1 - self.decay)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--decay", type=float, default=0.99)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)

    student = Student()
    teacher = EMATeacher(student, args.decay)
    model = DDP(student)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    dataset = make_data()
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    torch.manual_seed(77 + rank)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for (x,) in loader:
            v1, v2 = augment(x), augment(x)
            pred = model(torch.cat([v1, v2]))
            targ = teacher(torch.cat([v2, v1]))
            loss = 2 - 2 * F.cosine_similarity(pred, targ, dim=-1).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            # every rank applies the same update to identical weights
            teacher.update(model.module)
            step += 1
            if rank == 0 and step % 8 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)

    del model, optimizer
    dist.destroy_process_group()
    time.sleep(0.5)  # let gloo's background threads wind down before the interpreter exits


if __name__ == "__main__":
    main()
