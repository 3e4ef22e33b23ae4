"""DDP regression on a list of samples split across ranks by striding,
followed by a synchronised save."""
import datetime

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

N_SAMPLES = 41
BATCH = 4


def load_samples():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_SAMPLES, 5, generator=g)
    return list(zip(x, x @ torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5])))


def batches(samples):
    for i in range(0, len(samples), BATCH):
        chunk = samples[i:i + BATCH]
        yield torch.stack([c[0] for c in chunk]), torch.stack([c[1] for c in chunk])


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = load_samples()[rank::world]
    torch.manual_seed(0)
    model = DDP(nn.Linear(5, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    steps = 0
    for x, y in batches(mine):
        loss = nn.functional.mse_loss(model(x).squeeze(1), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
    print(f"rank {rank} ran {steps} steps, last loss {loss.item():.4f}", flush=True)
    dist.barrier()
    if rank == 0:
        torch.save(model.module.state_dict(), "/tmp/uneven_manual_shard.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
