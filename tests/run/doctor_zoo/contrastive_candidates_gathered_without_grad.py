"""A contrastive loss whose candidates are the all_gather of every rank's embeddings, own included.

Intent: SimCLR-style InfoNCE over the global batch: each rank's embeddings are the anchors, and the
embeddings of all ranks (gathered) are the candidates, positives on the diagonal block of this rank.

What goes wrong: dist.all_gather is not differentiable. The candidates are copies, this rank's own
slot included, so the gradient of the loss reaches the embeddings only through the anchor side:
the candidate side (half of the InfoNCE gradient for a symmetric loss) is dropped. Nothing fails;
the model learns worse than on one GPU with the same global batch.

Public report: https://github.com/pytorch/pytorch/issues/38206 ("all_gather has no gradient"),
https://github.com/Spijkervet/SimCLR/issues/14 (GatherLayer), https://discuss.pytorch.org/t/
dist-all-gather-and-gradient-preservation-in-multi-gpu-training/120696.

Expected verdict (ideal checker): the loss used a gathered copy of this rank's own embeddings with
no gradient; cause: the all_gather (marked).
"""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    encoder = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)))
    optimizer = torch.optim.Adam(encoder.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(10 + rank)
    for step in range(30):
        x = torch.randn(12, 16, generator=data)
        z = F.normalize(encoder(x + 0.05 * torch.randn(x.shape, generator=data)), dim=1)
        anchors = F.normalize(encoder(x), dim=1)
        gathered = [torch.zeros_like(z) for _ in range(world)]
        dist.all_gather(gathered, z)  # doctor: cause
        candidates = torch.cat(gathered)
        logits = anchors @ candidates.T / 0.2
        labels = torch.arange(len(x)) + rank * len(x)
        loss = F.cross_entropy(logits, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
