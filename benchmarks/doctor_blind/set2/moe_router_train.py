import os
import time

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

NUM_EXPERTS = 4
AUX_WEIGHT = 0.05
EPOCHS = 2
BATCH_SIZE = 32


def make_dataset(n=2048, dim=24, classes=5):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, classes, generator=g)
    y = (torch.tanh(x) @ w).argmax(dim=1)
    return TensorDataset(x, y)


class MoEClassifier(nn.Module):
    def __init__(self, dim=24, hidden=32, classes=5, num_experts=NUM_EXPERTS):
        super().__init__()
        self.router = nn.Linear(dim, num_experts)
        self.experts = nn.ModuleList(
            [nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)) for _ in range(num_experts)]
        )
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        probs = self.router(x).softmax(dim=-1)
        top = probs.argmax(dim=-1)
        gate = F.one_hot(top, probs.size(-1)).to(x.dtype) * probs
        expert_out = torch.stack([expert(x) for expert in self.experts], dim=1)
        h = x + (gate.unsqueeze(-1) * expert_out).sum(dim=1)
        return self.head(h), probs, top


def load_balancing_loss(probs, top):
    num_experts = probs.size(-1)
    counts = torch.bincount(top, minlength=num_experts).float()
    # routing statistics over the global batch
    dist_nn.all_reduce(counts)
    token_frac = counts / counts.sum()
    prob_frac = probs.mean(dim=0)
    return num_experts * (token_frac * prob_frac).sum()


def train(rank, world_size):
    torch.manual_seed(0)
    model = DDP(MoEClassifier())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)

    dataset = make_dataset()
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler, drop_last=True)

    step = 0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in loader:
            logits, probs, top = model(x)
            task_loss = F.cross_entropy(logits, y)
            aux_loss = load_balancing_loss(probs, top)
            loss = task_loss + AUX_WEIGHT * aux_loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if rank == 0 and step % 16 == 0:
                print(f"epoch {epoch} step {step} task {task_loss.item():.4f} aux {aux_loss.item():.4f}")


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
