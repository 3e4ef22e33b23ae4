"""Healthy: copies of a model taken after DDP wrapped it. A snapshot of the wrapper before the first
step (`copy.deepcopy(ddp)`), an EMA teacher copied from the inner module (`copy.deepcopy(ddp.module)`)
and updated from the student after every step, on every rank alike, and a snapshot of the
optimizer. Every copy must hold what the script's objects hold, and nothing of a launcher's: under
plain torchrun each deepcopy succeeds and the teacher agrees on every rank. Prints, per step, the
loss and the teacher's distance to the snapshot."""

import copy
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

STEPS = 14


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    gen = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(512, 16, generator=gen), torch.randn(512, 1, generator=gen))
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=16, sampler=sampler)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    ddp = DDP(model)
    snapshot = copy.deepcopy(ddp)  # doctor: lookalike
    teacher = copy.deepcopy(ddp.module).requires_grad_(False)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    step = 0
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            with torch.no_grad():
                for t, s in zip(teacher.parameters(), ddp.module.parameters()):
                    t.mul_(0.9).add_(s, alpha=0.1)
                drift = sum((t - p).abs().sum() for t, p in zip(teacher.parameters(), snapshot.module.parameters()))
            if step == 3:
                saved = copy.deepcopy(opt.state_dict())
                print(f"rank {rank}: optimizer snapshot of {len(saved['state'])} parameters")
            print(f"rank {rank} step {step}: loss {loss.item():.6f} teacher drift {drift.item():.6f}")
            if step == STEPS:
                break
        if step == STEPS:
            break
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
