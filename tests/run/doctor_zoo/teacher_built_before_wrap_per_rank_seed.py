"""Mean-teacher training: the teacher is a deepcopy of the student, made before DDP wraps the student,
after each rank was seeded with a seed of its own (for its own augmentations). DDP broadcasts rank
0's student weights at construction; the teacher, which DDP never sees, keeps each rank's own
initialisation. Every later EMA update moves each rank's teacher toward the same student, so the
teachers never meet: each rank's consistency loss pulls toward its own targets."""

import copy
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = 16
DECAY = 0.99


@torch.no_grad()
def ema(teacher: nn.Module, student: nn.Module) -> None:
    for t, s in zip(teacher.parameters(), student.parameters()):
        t.mul_(DECAY).add_(s, alpha=1 - DECAY)


def train(rank: int) -> None:
    torch.manual_seed(100 + rank)
    student = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    teacher = copy.deepcopy(student).requires_grad_(False)  # doctor: cause
    model = DDP(student)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    for step in range(1, STEPS + 1):
        x, y = torch.randn(16, 16, generator=gen), torch.randint(0, 4, (16,), generator=gen)
        logits = model(x + 0.1 * torch.randn_like(x))
        with torch.no_grad():
            target = teacher(x).softmax(dim=1)
        loss = F.cross_entropy(logits, y) + F.mse_loss(logits.softmax(dim=1), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ema(teacher, model.module)


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    train(int(os.environ["RANK"]))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
