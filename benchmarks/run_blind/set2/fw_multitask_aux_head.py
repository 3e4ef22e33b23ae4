"""Hand-rolled multi-task trainer on 2 ranks (Lightning-style module with training_step
and a fit loop): a shared encoder feeds a classification head on every sample and an
auxiliary box-regression head on the samples that carry a box annotation; the module is
wrapped in DDP and trained for two epochs on a synthetic detection-like dataset."""
import datetime

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


class DetectionLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.cls_head = nn.Linear(32, 3)
        self.box_head = nn.Linear(32, 4)

    def forward(self, x, has_box):
        h = self.encoder(x)
        logits = self.cls_head(h)
        boxes = self.box_head(h[has_box]) if bool(has_box.any()) else None
        return logits, boxes


class Module:
    def __init__(self):
        torch.manual_seed(0)
        self.net = DetectionLike()

    def training_step(self, model, batch):
        x, y, has_box, box = batch
        logits, boxes = model(x, has_box)
        loss = nn.functional.cross_entropy(logits, y)
        if boxes is not None:
            loss = loss + nn.functional.smooth_l1_loss(boxes, box[has_box])
        return loss


def dataset(n=128):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, 16, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    has_box = torch.tensor([i % 4 == 0 for i in range(n)])
    box = torch.randn(n, 4, generator=g)
    return x, y, has_box, box


class Trainer:
    def __init__(self, epochs=2, batch_size=16):
        self.epochs, self.batch_size = epochs, batch_size
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def fit(self, module, data):
        model = DDP(module.net)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        shard = [t[self.rank::self.world] for t in data]
        for epoch in range(self.epochs):
            for i in range(0, len(shard[0]), self.batch_size):
                batch = [t[i:i + self.batch_size] for t in shard]
                loss = module.training_step(model, batch)
                opt.zero_grad()
                loss.backward()
                opt.step()
            if self.rank == 0:
                print(f"epoch {epoch} loss {loss.item():.4f}", flush=True)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    Trainer().fit(Module(), dataset())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
