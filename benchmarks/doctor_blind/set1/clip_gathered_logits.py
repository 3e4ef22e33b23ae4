"""Image-text contrastive training that uses negatives from every rank (global batch)."""
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


def paired_dataset(n=2048, latent=16, img_dim=64, txt_dim=48, seed=11):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, latent, generator=g)
    img = z @ torch.randn(latent, img_dim, generator=g) + 0.5 * torch.randn(n, img_dim, generator=g)
    txt = z @ torch.randn(latent, txt_dim, generator=g) + 0.5 * torch.randn(n, txt_dim, generator=g)
    return TensorDataset(img, txt)


class TwoTower(nn.Module):
    def __init__(self, img_dim=64, txt_dim=48, embed=32, hidden=128):
        super().__init__()
        self.img = nn.Sequential(nn.Linear(img_dim, hidden), nn.ReLU(), nn.Linear(hidden, embed))
        self.txt = nn.Sequential(nn.Linear(txt_dim, hidden), nn.ReLU(), nn.Linear(hidden, embed))

    def forward(self, img, txt):
        return F.normalize(self.img(img), dim=-1), F.normalize(self.txt(txt), dim=-1)


def gather_features(feats):
    world_size = dist.get_world_size()
    out = [torch.zeros_like(feats) for _ in range(world_size)]
    dist.all_gather(out, feats)
    return torch.cat(out, dim=0)


def global_clip_loss(img_emb, txt_emb, rank, temperature=0.07):
    all_img = gather_features(img_emb)
    all_txt = gather_features(txt_emb)
    logits_per_image = img_emb @ all_txt.t() / temperature
    logits_per_text = txt_emb @ all_img.t() / temperature
    labels = torch.arange(img_emb.size(0)) + rank * img_emb.size(0)
    return 0.5 * (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_text, labels))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)

    dataset = paired_dataset()
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    model = DDP(TwoTower())
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for img, txt in loader:
            img_emb, txt_emb = model(img, txt)
            loss = global_clip_loss(img_emb, txt_emb, rank)
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
