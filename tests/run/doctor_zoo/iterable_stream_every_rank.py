"""An IterableDataset that streams every record on every rank.

Intent: read a log of records in order, as a stream; a DistributedSampler cannot be given to an
IterableDataset, so the loader was built without one.

What goes wrong: each rank's copy of the stream walks all the records, so both ranks train on the
same batches in the same order: the job does the work of one process twice, and an "epoch" visits
every record world_size times. Nothing fails.

Public report: https://github.com/pytorch/pytorch/issues/46136 (IterableDataset and DDP: every
replica yields the whole stream), https://discuss.pytorch.org/t/iterabledataset-with-ddp/ .

Expected verdict (ideal checker): every rank fed identical batches; cause: the loop of the stream's
`__iter__` that walks every record without taking the rank into account (marked).
"""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset


class RecordLog(IterableDataset):
    def __init__(self, records=960):
        g = torch.Generator().manual_seed(9)
        self.x = torch.randn(records, 6, generator=g)
        self.y = (self.x[:, :2].sum(1) > 0).long()

    def __iter__(self):
        for i in range(len(self.x)):  # doctor: cause
            yield self.x[i], self.y[i]


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    loader = DataLoader(RecordLog(), batch_size=32)
    model = DDP(nn.Sequential(nn.Linear(6, 24), nn.ReLU(), nn.Linear(24, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, (x, y) in enumerate(loader):
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
