"""Mistake: FSDP2 training with gradient clipping written by hand from each rank's LOCAL gradient
shards (`p.grad.to_local()`): every rank computes a different "total" norm, so the clip coefficient
differs by rank and each rank scales its own shard of every gradient by its own factor. The update is
no longer a clipped version of the true gradient; no collective is involved, so nothing errors."""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

MAX_NORM = 0.05


def train(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    gen = torch.Generator().manual_seed(161)
    x = torch.randn(512, 32, generator=gen)
    y = torch.tanh(x[:, :8].sum(dim=1, keepdim=True)) + 0.1 * torch.randn(512, 1, generator=gen)
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)  # 256 samples, 16 batches per rank
    loader = DataLoader(dataset, batch_size=16, sampler=sampler)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 1))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler.set_epoch(0)
    for xb, yb in loader:
        loss = F.mse_loss(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        local_norm = torch.norm(torch.stack([p.grad.to_local().norm() for p in model.parameters()]))
        coef = (MAX_NORM / (local_norm + 1e-6)).clamp(max=1.0)
        for p in model.parameters():
            p.grad.mul_(coef)  # doctor: cause
        opt.step()
    last = torch.tensor([loss.item()])
    dist.all_reduce(last)  # last step's loss summed over the ranks, for the run summary


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    train(rank, dist.get_world_size())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
