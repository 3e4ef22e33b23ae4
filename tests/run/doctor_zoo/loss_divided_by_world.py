"""The loss is summed over the local batch and divided by batch_size * world_size ("the global
batch"), but DDP already averages the gradients over the ranks: every update is 1/world_size of the
intended one, as if the learning rate were halved. Nothing fails."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world_size = dist.get_world_size()
    batch_size = 16
    gen = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(256, 16, generator=gen), torch.randint(0, 4, (256,), generator=gen))
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)  # 128 samples, 8 batches per rank
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)

    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            logits = ddp(x)
            loss = F.cross_entropy(logits, y, reduction="sum") / (batch_size * world_size)  # doctor: loss
            opt.zero_grad()
            loss.backward()  # doctor: backward
            opt.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
