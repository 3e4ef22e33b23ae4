"""Multi-task MLP trained with DDP: a main classification head plus an auxiliary regression head on the shared trunk."""
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU())
        self.cls_head = nn.Linear(32, 4)
        self.aux_head = None

    def forward(self, x):
        h = self.trunk(x)
        logits = self.cls_head(h)
        if self.aux_head is None:
            return logits, None
        return logits, self.aux_head(h)


def batch(gen, w):
    x = torch.randn(32, 16, generator=gen)
    y = (x @ w).argmax(1)
    aux = x[:, :2].pow(2).sum(1, keepdim=True)
    return x, y, aux


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    torch.manual_seed(0)

    model = Net()
    model.aux_head = nn.Linear(32, 1)
    model = DDP(model)

    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    w = torch.randn(16, 4, generator=torch.Generator().manual_seed(4))
    gen = torch.Generator().manual_seed(1000 + rank)
    for step in range(40):
        x, y, aux = batch(gen, w)
        logits, aux_pred = model(x)
        loss = F.cross_entropy(logits, y) + 0.5 * F.mse_loss(aux_pred, aux)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}")

    dist.barrier()
    dist.destroy_process_group()
    time.sleep(1)


if __name__ == "__main__":
    main()
