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
MAX_GRAD_NORM = 1.0


def make_dataset(n=2048, seq=8, dim=16, classes=4):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, seq, dim, generator=g)
    w = torch.randn(dim, classes, generator=g)
    y = (x.mean(dim=1) @ w).argmax(dim=1)
    return TensorDataset(x, y)


class TinyTransformer(nn.Module):
    def __init__(self, dim=16, classes=4):
        super().__init__()
        self.proj = nn.Linear(dim, 32)
        layer = nn.TransformerEncoderLayer(32, nhead=4, dim_feedforward=64, batch_first=True, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, num_layers=1)
        self.head = nn.Linear(32, classes)

    def forward(self, x):
        return self.head(self.encoder(self.proj(x)).mean(dim=1))


def train(rank, world_size):
    torch.manual_seed(0)
    model = DDP(TinyTransformer())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    scaler = torch.amp.GradScaler("cpu")

    dataset = make_dataset()
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler)

    step = 0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(x)
            loss = F.cross_entropy(logits.float(), y)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
            scaler.step(optimizer)
            scaler.update()
            step += 1
            if rank == 0 and step % 16 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} grad_norm {grad_norm.item():.2f}")


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
