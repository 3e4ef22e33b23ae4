"""2-D (dp, tp) device-mesh setup behind a cached getter. The main process
prints the parallel plan at start-up; all ranks then create an I/O group for
sharded data loading and train the tensor-parallel block."""
import datetime

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

_MESH = None


def get_mesh():
    global _MESH
    if _MESH is None:
        world = dist.get_world_size()
        _MESH = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    return _MESH


def describe_plan():
    mesh = get_mesh()
    print(f"parallel plan: dp={mesh['dp'].size()} tp={mesh['tp'].size()} mesh={mesh.mesh.tolist()}", flush=True)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    rank = dist.get_rank()
    if rank == 0:
        describe_plan()
    io_group = dist.new_group(backend="gloo")
    seed = torch.tensor([1234])
    dist.broadcast(seed, src=0, group=io_group)

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    block = parallelize_module(block, get_mesh()["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.SGD(block.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(int(seed))
    for step in range(8):
        x = torch.randn(8, 16, generator=g)
        loss = (block(x) - x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"rank {rank} loss {loss.item():.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
