"""Rank 1's DataLoader workers decode slowly: its first batch needs about 6 s of CPU in the
`__getitem__` of one of its two workers, while rank 0 waits in the gradient all-reduce of its first step. Rank 1's
main thread only waits for the batch; the work is in its worker processes: the rank is working,
not stuck. Then both ranks finish 3 steps. Plain torchrun: exit 0."""

import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset


class SlowDecode(Dataset):
    """Samples that take `cpu_s` of CPU each to decode on rank 1 (the first batch only), none elsewhere."""

    def __init__(self, rank: int, cpu_s: float) -> None:
        self.rank, self.cpu_s = rank, cpu_s

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int):
        if self.rank == 1 and index < 4:
            until = time.process_time() + self.cpu_s
            while time.process_time() < until:  # zoo: decode
                pass
        gen = torch.Generator().manual_seed(index)
        return torch.randn(8, generator=gen), torch.randn(1, generator=gen)


def main() -> None:
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = DDP(nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(SlowDecode(rank, cpu_s=1.5), batch_size=4, num_workers=2)
    for x, y in loader:  # zoo: next_batch
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()  # zoo: backward
        opt.step()
    print(f"rank {rank}: done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
