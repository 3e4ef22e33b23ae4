"""Each data-parallel shard group agrees on a per-shard augmentation seed chosen
by the shard leader, then the whole job trains with DDP."""
import datetime
import os

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

SHARDS = int(os.environ.get("NUM_SHARD_GROUPS", "2"))


def shard_seed(group):
    seed = torch.tensor([0], dtype=torch.int64)
    if dist.get_rank(group) == 0:
        seed[0] = int.from_bytes(os.urandom(4), "little")
    dist.broadcast(seed, src=0, group=group)
    return int(seed.item())


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    shard_group, _ = dist.new_subgroups(group_size=world // SHARDS)
    seed = shard_seed(shard_group)
    print(f"rank {rank} shard seed {seed}", flush=True)

    g = torch.Generator().manual_seed(seed)
    model = DDP(nn.Linear(12, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(10):
        x = torch.randn(8, 12, generator=g)
        noise = 0.1 * torch.randn(8, 12, generator=g)
        loss = nn.functional.cross_entropy(model(x + noise), x[:, :3].argmax(1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
