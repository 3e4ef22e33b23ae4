"""Contrastive pretraining with a stop-gradient key branch and a cross-rank key bank."""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def make_data(n=2048, dim=48, clusters=64, seed=21):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(clusters, dim, generator=g) * 2
    idx = torch.randint(0, clusters, (n,), generator=g)
    return TensorDataset(centers[idx] + 0.3 * torch.randn(n, dim, generator=g))


def augment(x):
    return x * (torch.rand_like(x) > 0.2).float() + 0.2 * torch.randn_like(x)


class SiameseNet(nn.Module):
    def __init__(self, dim=48, hidden=128, out=32):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, out))
        self.predictor = nn.Sequential(nn.Linear(out, hidden), nn.ReLU(), nn.Linear(hidden, out))

    def forward(self, x_q, x_k):
        q = F.normalize(self.predictor(self.encoder(x_q)), dim=-1)
        with torch.no_grad():
            k = F.normalize(self.encoder(x_k), dim=-1)
        return q, k


@torch.no_grad()
def concat_all_keys(keys):
    bank = [torch.empty_like(keys)] * dist.get_world_size()
    dist.all_gather(bank, keys)
    return torch.cat(bank, dim=0)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--tau", type=float, default=0.2)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)

    dataset = make_data()
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    model = DDP(SiameseNet())
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    torch.manual_seed(1000 + rank)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for (x,) in loader:
            q, k = model(augment(x), augment(x))
            all_k = concat_all_keys(k)
            logits = q @ all_k.t() / args.tau
            labels = torch.arange(q.size(0)) + rank * q.size(0)
            loss = F.cross_entropy(logits, labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if rank == 0 and step % 8 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)

    del model, optimizer
    dist.destroy_process_group()
    time.sleep(0.5)  # let gloo's background threads wind down before the interpreter exits


if __name__ == "__main__":
    main()
