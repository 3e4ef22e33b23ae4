"""Every rank creates every group, members or not, in the same order: an evaluation group of rank 0
alone (rank 1 gets GroupMember.NON_GROUP_MEMBER and never uses it), then a group for the metrics,
and a device mesh. Exits 0 on every rank."""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    eval_group = dist.new_group([0])
    metrics_group = dist.new_group([0, 1])
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)), process_group=mesh.get_group("dp"))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)
    for _ in range(4):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    if rank == 0:
        dist.barrier(group=eval_group)
    total = torch.tensor([loss.item()])
    dist.all_reduce(total, group=metrics_group)
    print(f"rank {rank}: mean loss {total.item() / 2:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
