import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

MAX_GRAD_NORM = 1.0
AMP_DTYPE = torch.bfloat16


class ResidualMLP(nn.Module):
    def __init__(self, d=48, n_blocks=2, n_classes=10):
        super().__init__()
        self.inp = nn.Linear(20, d)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)) for _ in range(n_blocks)
        )
        self.out = nn.Linear(d, n_classes)

    def forward(self, x):
        h = self.inp(x)
        for blk in self.blocks:
            h = h + blk(h)
        return self.out(h)


def make_data(n=1024, seed=55):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 20, generator=g)
    w = torch.randn(20, 10, generator=g)
    y = (x @ w + 0.5 * torch.randn(n, 10, generator=g)).argmax(1)
    return TensorDataset(x, y)


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    torch.manual_seed(0)

    data = make_data()
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(data, batch_size=32, sampler=sampler, drop_last=True)

    model = DDP(ResidualMLP())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    scaler = torch.amp.GradScaler("cpu")

    step = 0
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device_type="cpu", dtype=AMP_DTYPE):
                logits = model(x)
                loss = F.cross_entropy(logits, y)
            scaler.scale(loss).backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
            scaler.step(optimizer)
            scaler.update()
            step += 1
            if rank == 0 and step % 8 == 0:
                print(f"step {step} loss {loss.item():.4f} grad_norm {grad_norm.item():.3e} scale {scaler.get_scale():.0f}", flush=True)

    dist.barrier()
    dist.destroy_process_group()
    time.sleep(1)


if __name__ == "__main__":
    main()
