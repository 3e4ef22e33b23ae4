"""The blocks live in an nn.ModuleDict built by iterating the block names in an order that differs
between the processes, as iterating a Python set of strings does (string hashes, hence set order,
change with each process's PYTHONHASHSEED). Here the per-rank order comes from hashing (index, rank)
tuples of integers, which is deterministic, so the difference shows on every run. All blocks have the
same shape, so DDP's construction check passes and it broadcasts rank 0's parameters by position:
rank 1's parameter "blocks.mix.weight" receives rank 0's "blocks.<other>.weight". Training still runs
(the forward applies the blocks in position order on each rank), but the same name means a different
tensor on each rank: rank 1's checkpoint, name-based loading or name-based param groups are wrong.
Nothing fails."""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

BLOCKS = ("embed", "mix", "gate", "proj")


class Net(nn.Module):
    def __init__(self, names: list[str]) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({name: nn.Linear(16, 16) for name in names})
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks.values():
            x = x + torch.tanh(block(x))
        return self.head(x)


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    names = sorted(BLOCKS, key=lambda n: hash((BLOCKS.index(n), rank)) % 1000)  # stands in for list(set(BLOCKS))
    gen = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(256, 16, generator=gen), torch.randn(256, 1, generator=gen))
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)  # 128 samples, 8 batches per rank
    loader = DataLoader(dataset, batch_size=16, sampler=sampler)

    torch.manual_seed(0)
    ddp = DDP(Net(names))  # doctor: ddp
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
