"""DDP training with annealed Gaussian gradient noise (Neelakantan et al., 2015) as a regulariser."""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def make_dataset(n=2048, dim=32, classes=4, seed=19):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w1 = torch.randn(dim, 64, generator=g)
    w2 = torch.randn(64, classes, generator=g)
    return TensorDataset(x, (torch.tanh(x @ w1) @ w2).argmax(dim=1))


class DeepMLP(nn.Module):
    def __init__(self, dim=32, hidden=128, depth=4, classes=4):
        super().__init__()
        layers = [nn.Linear(dim, hidden), nn.ReLU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(hidden, hidden), nn.ReLU()]
        layers.append(nn.Linear(hidden, classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--noise-eta", type=float, default=0.01)
    parser.add_argument("--noise-gamma", type=float, default=0.55)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(args.seed)

    model = DDP(DeepMLP())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    dataset = make_dataset()
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    torch.manual_seed(args.seed + rank)  # decorrelate input noise across workers

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x = x + 0.05 * torch.randn_like(x)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            std = math.sqrt(args.noise_eta / (1 + step) ** args.noise_gamma)
            for p in model.parameters():
                p.grad.add_(torch.randn_like(p.grad) * std)
            optimizer.step()
            step += 1
            if rank == 0 and step % 8 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} noise_std {std:.4f}", flush=True)

    del model, optimizer
    dist.destroy_process_group()
    time.sleep(0.5)  # let gloo's background threads wind down before the interpreter exits


if __name__ == "__main__":
    main()
