"""CLIP-style dual encoder with a learnable temperature, trained with DDP."""
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


def paired_dataset(n=2048, latent=16, img_dim=64, txt_dim=48, seed=3):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, latent, generator=g)
    a = torch.randn(latent, img_dim, generator=g)
    b = torch.randn(latent, txt_dim, generator=g)
    img = z @ a + 0.5 * torch.randn(n, img_dim, generator=g)
    txt = z @ b + 0.5 * torch.randn(n, txt_dim, generator=g)
    return TensorDataset(img, txt)


class CLIPLike(nn.Module):
    def __init__(self, img_dim=64, txt_dim=48, embed=32, hidden=128):
        super().__init__()
        self.image_tower = nn.Sequential(nn.Linear(img_dim, hidden), nn.GELU(), nn.Linear(hidden, embed))
        self.text_tower = nn.Sequential(nn.Linear(txt_dim, hidden), nn.GELU(), nn.Linear(hidden, embed))
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, img, txt):
        img_emb = F.normalize(self.image_tower(img), dim=-1)
        txt_emb = F.normalize(self.text_tower(txt), dim=-1)
        return self.logit_scale.exp() * img_emb @ txt_emb.t()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)

    dataset = paired_dataset()
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    model = DDP(CLIPLike())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for img, txt in loader:
            logits = model(img, txt)
            labels = torch.arange(logits.size(0))
            loss = 0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            # same clamp on every rank, so the replicas stay identical
            with torch.no_grad():
                model.module.logit_scale.clamp_(0, math.log(100))
            step += 1
            if rank == 0 and step % 8 == 0:
                temp = model.module.logit_scale.exp().item()
                print(f"step {step} loss {loss.item():.4f} temp {temp:.2f}", flush=True)

    del model, optimizer
    dist.destroy_process_group()
    time.sleep(0.5)  # let gloo's background threads wind down before the interpreter exits


if __name__ == "__main__":
    main()
