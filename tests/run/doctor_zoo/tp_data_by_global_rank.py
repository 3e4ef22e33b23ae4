"""Tensor parallelism over both ranks, but each rank takes its batches from a DistributedSampler
that splits the data by the global rank, as a DDP script would: the two halves of every split
layer learn from different batches. Nothing fails; the model is silently wrong."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    gen = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(128, 16, generator=gen), torch.randn(128, 16, generator=gen))
    loader = DataLoader(dataset, batch_size=16, sampler=DistributedSampler(dataset))  # doctor: loader
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    model = parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})  # doctor: parallelize
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in loader:
        loss = F.mse_loss(model(x), y)  # doctor: forward
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
