"""Cold-cache decoding: rank 0's first batches take ~21 s in DataLoader workers.

Mechanism (a), HEALTHY. Each of rank 0's first 16 samples is "decoded" in
__getitem__ by a ~2.6 s CPU loop (cold cache for rank 0's shard only). With
num_workers=2 and batch_size=4, rank 0's two workers each decode 8 samples
in parallel before rank 0 has its third batch (~21 s); meanwhile rank 1 sits
in DDP's gradient all-reduce waiting for rank 0. Afterwards every sample is
fast, training finishes, exit code 0 on both ranks.

Drawn from: https://github.com/Lightning-AI/pytorch-lightning/issues/18149
("DDP with DataLoader num_workers>0 ..." -- a __getitem__ that takes ~2 s per
call looked like a stuck first step under DDP).
"""
import math
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  (before init_process_group)
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DECODE_SECONDS = 2.6
COLD_RANK = 0


class SlowDecodeImages(Dataset):
    """8x8 single-channel "images"; the cold shard pays for decoding once."""

    def __init__(self, n=128):
        self.n = n
        self.cold = int(os.environ["RANK"]) == COLD_RANK

    def __len__(self):
        return self.n

    def _decode(self, idx):
        deadline = time.monotonic() + DECODE_SECONDS
        acc = 0.0
        while time.monotonic() < deadline:
            for k in range(500):
                acc += math.sin(idx * 0.001 + k)
        return acc

    def __getitem__(self, idx):
        if self.cold and idx < 32:
            self._decode(idx)
        g = torch.Generator().manual_seed(idx)
        img = torch.rand(1, 8, 8, generator=g)
        label = int(img.mean() > 0.5)
        return img, label


class TinyConv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3, padding=1)
        self.head = torch.nn.Linear(4 * 8 * 8, 2)

    def forward(self, x):
        return self.head(F.relu(self.conv(x)).flatten(1))


def run():
    rank, world = dist.get_rank(), dist.get_world_size()
    data = SlowDecodeImages()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False)
    loader = DataLoader(data, batch_size=4, sampler=sampler, num_workers=2)
    net = DistributedDataParallel(TinyConv())
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    start = time.time()
    seen = 0
    for imgs, labels in loader:  # zoo: slow-batches
        out = net(imgs)
        loss = F.cross_entropy(out, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # zoo: peer-wait
        opt.step()
        seen += 1
        if seen in (1, 3):
            print(f"rank{rank}: batch {seen} at {time.time() - start:5.1f}s", flush=True)
    print(f"rank{rank}: done {seen} batches, loss={loss.item():.3f}", flush=True)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    run()
    dist.barrier()
    dist.destroy_process_group()
