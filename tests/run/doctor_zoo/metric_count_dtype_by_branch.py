"""Mistake: the loss is normalised by the number of positives over all ranks, but the count is
built as an int32 tensor when the local batch has positives and as `torch.zeros(1)` (float32) when
it has none, which happens on rank 1 at some steps. Both are 4 bytes, so Gloo sums the bytes of two
dtypes without complaint: the ranks read back different, wrong counts and scale their losses (and
so their gradient contributions) differently."""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def make_dataset() -> TensorDataset:
    gen = torch.Generator().manual_seed(51)
    n = 256
    idx = torch.arange(n)
    # rare positives: every block of 16 gives rank 0 (even indices) one positive; rank 1 (odd
    # indices) gets one in two blocks out of three
    y = ((idx % 16 == 0) | ((idx % 16 == 1) & ((idx // 16) % 3 != 0))).float()
    x = torch.randn(n, 12, generator=gen) + 1.5 * y[:, None]
    return TensorDataset(x, y)


def train(rank: int) -> None:
    dataset = make_dataset()
    sampler = DistributedSampler(dataset, shuffle=False)  # 128 samples, 16 batches per rank
    loader = DataLoader(dataset, batch_size=8, sampler=sampler)

    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for epoch in range(2):
        for x, y in loader:
            logits = ddp(x).squeeze(1)
            positives = y > 0.5
            if positives.any():
                num_pos = torch.tensor([int(positives.sum())], dtype=torch.int32)
            else:
                num_pos = torch.zeros(1)
            dist.all_reduce(num_pos)  # doctor: cause
            norm = max(float(num_pos.item()), 1.0)
            loss = F.binary_cross_entropy_with_logits(logits, y, reduction="sum") / norm
            opt.zero_grad()
            loss.backward()
            opt.step()
    last = torch.tensor([loss.item()])
    dist.all_reduce(last)  # last step's loss summed over the ranks, for the run summary


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    train(rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
