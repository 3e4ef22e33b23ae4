"""Semi-supervised mean-teacher training of an MLP classifier with DDP: the student is trained, the teacher is an EMA of the student."""
import copy
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def make_net():
    return nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 3))


def sample_batch(gen, centers, batch=48):
    labels = torch.randint(0, 3, (batch,), generator=gen)
    x = centers[labels] + torch.randn(batch, 10, generator=gen)
    return x, labels


@torch.no_grad()
def update_teacher(teacher, student, decay):
    for t, s in zip(teacher.parameters(), student.parameters()):
        t.mul_(decay).add_(s, alpha=1.0 - decay)


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)

    # different augmentation noise on every rank
    torch.manual_seed(100 + rank)
    data_gen = torch.Generator().manual_seed(500 + rank)
    centers = 1.5 * torch.randn(3, 10, generator=torch.Generator().manual_seed(9))

    student = make_net()
    student = DDP(student)
    teacher = copy.deepcopy(student.module)
    for p in teacher.parameters():
        p.requires_grad_(False)

    optimizer = torch.optim.Adam(student.parameters(), lr=1e-3)
    decay, cons_weight, n_labeled = 0.99, 2.0, 12

    for step in range(40):
        x, y = sample_batch(data_gen, centers)
        view_s = x + 0.3 * torch.randn_like(x)
        view_t = x + 0.3 * torch.randn_like(x)
        logits_s = student(view_s)
        with torch.no_grad():
            logits_t = teacher(view_t)
        sup = F.cross_entropy(logits_s[:n_labeled], y[:n_labeled])
        cons = F.mse_loss(logits_s.softmax(-1), logits_t.softmax(-1))
        loss = sup + cons_weight * cons
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        update_teacher(teacher, student.module, decay)
        if rank == 0 and step % 10 == 0:
            print(f"step {step} sup {sup.item():.4f} cons {cons.item():.5f}")

    dist.barrier()
    dist.destroy_process_group()
    time.sleep(1)


if __name__ == "__main__":
    main()
