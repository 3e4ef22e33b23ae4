"""A contrastive loss over gathered candidates with this rank's own slot put back: correct.

The twin of contrastive_candidates_gathered_without_grad.py: after dist.all_gather, the script
puts its own embeddings (which carry the gradient) back in their slot before concatenating, as
SimCLR and CLIP implementations do. Every rank's features get their full gradient from the loss
its own rank computes; the other ranks' slots are constants, as intended. A gather of predictions
for a metric beside it, under no_grad, is not part of any loss.
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
        dist.all_gather(gathered, z)  # doctor: lookalike
        gathered[rank] = z
        candidates = torch.cat(gathered)
        logits = anchors @ candidates.T / 0.2
        labels = torch.arange(len(x)) + rank * len(x)
        loss = F.cross_entropy(logits, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            predictions = [torch.zeros_like(logits) for _ in range(world)]
            dist.all_gather(predictions, logits)
            accuracy = (torch.cat(predictions).argmax(1) == torch.arange(len(x) * world) % (len(x) * world)).float().mean()
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f} accuracy {accuracy.item():.2f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
