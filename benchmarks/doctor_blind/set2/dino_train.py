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
BATCH_SIZE = 16
OUT_DIM = 64
MOMENTUM_TEACHER = 0.99


def make_dataset(n=1024, dim=32, clusters=10):
    g = torch.Generator().manual_seed(0)
    centers = 2.0 * torch.randn(clusters, dim, generator=g)
    idx = torch.randint(0, clusters, (n,), generator=g)
    return TensorDataset(centers[idx] + 0.5 * torch.randn(n, dim, generator=g))


def augment(x):
    keep = (torch.rand_like(x) > 0.15).to(x.dtype)
    return x * keep + 0.2 * torch.randn_like(x)


class DINOHead(nn.Module):
    def __init__(self, dim=32, hidden=64, bottleneck=16, out_dim=OUT_DIM):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU())
        self.mlp = nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, bottleneck))
        self.last_layer = nn.Linear(bottleneck, out_dim, bias=False)

    def forward(self, x):
        h = F.normalize(self.mlp(self.backbone(x)), dim=-1)
        return self.last_layer(h)


class DINOLoss(nn.Module):
    def __init__(self, out_dim, student_temp=0.1, teacher_temp=0.04, center_momentum=0.9):
        super().__init__()
        self.student_temp = student_temp
        self.teacher_temp = teacher_temp
        self.center_momentum = center_momentum
        self.register_buffer("center", torch.zeros(1, out_dim))

    def forward(self, student_out, teacher_out):
        s1, s2 = student_out.chunk(2)
        t1, t2 = F.softmax((teacher_out - self.center) / self.teacher_temp, dim=-1).detach().chunk(2)
        loss = 0.5 * (
            -(t1 * F.log_softmax(s2 / self.student_temp, dim=-1)).sum(-1).mean()
            - (t2 * F.log_softmax(s1 / self.student_temp, dim=-1)).sum(-1).mean()
        )
        self.update_center(teacher_out)
        return loss

    @torch.no_grad()
    def update_center(self, teacher_out):
        batch_center = torch.sum(teacher_out, dim=0, keepdim=True)
        dist.all_reduce(batch_center)
        batch_center = batch_center / len(teacher_out)
        self.center = self.center * self.center_momentum + batch_center * (1 - self.center_momentum)


def train(rank, world_size):
    torch.manual_seed(0)
    student = DDP(DINOHead())
    teacher = copy.deepcopy(student.module)
    for p in teacher.parameters():
        p.requires_grad_(False)
    criterion = DINOLoss(OUT_DIM)
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-3, weight_decay=0.04)
    torch.manual_seed(100 + rank)

    dataset = make_dataset()
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler, drop_last=True)

    step = 0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for (x,) in loader:
            views = torch.cat([augment(x), augment(x)], dim=0)
            with torch.no_grad():
                teacher_out = teacher(views)
            student_out = student(views)
            loss = criterion(student_out, teacher_out)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            with torch.no_grad():
                for pt, ps in zip(teacher.parameters(), student.module.parameters()):
                    pt.mul_(MOMENTUM_TEACHER).add_(ps.detach(), alpha=1 - MOMENTUM_TEACHER)
            step += 1
            if rank == 0 and step % 16 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} center_norm {criterion.center.norm():.4f}")


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
