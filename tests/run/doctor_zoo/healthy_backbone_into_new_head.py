"""Healthy: fine-tuning a pretrained 10-class model for a 3-class task. The pretrained state dict is
loaded with `strict=False` after dropping its `head.` entries, so every backbone key loads and only the
new head's weight and bias are missing, which is the intent (the head is freshly initialised).
Looks like the silent "nothing loaded" mistake, but the keys match."""

import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class Net(nn.Module):
    def __init__(self, classes: int) -> None:
        super().__init__()
        self.stem = nn.Linear(24, 48)
        self.body = nn.Sequential(nn.ReLU(), nn.Linear(48, 32), nn.ReLU())
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.body(self.stem(x))))


def pretrain(path: str) -> None:
    # stands in for an earlier job on a 10-class task
    gen = torch.Generator().manual_seed(91)
    x = torch.randn(256, 24, generator=gen)
    y = (x[:, :10] * 3).argmax(dim=1)
    torch.manual_seed(0)
    net = Net(classes=10)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for i in range(8):
        opt.zero_grad()
        F.cross_entropy(net(x[i * 32:(i + 1) * 32]), y[i * 32:(i + 1) * 32]).backward()
        opt.step()
    torch.save(net.state_dict(), path)


def finetune(rank: int, path: str) -> None:
    gen = torch.Generator().manual_seed(92)
    x = torch.randn(512, 24, generator=gen)
    y = (x[:, :3].sum(dim=1) > 0).long() + (x[:, 3] > 0.5).long()
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)  # 256 samples, 16 batches per rank
    loader = DataLoader(dataset, batch_size=16, sampler=sampler)

    torch.manual_seed(1)
    model = Net(classes=3)
    pretrained = {k: v for k, v in torch.load(path).items() if not k.startswith("head.")}
    model.load_state_dict(pretrained, strict=False)  # doctor: lookalike
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    sampler.set_epoch(0)
    for xb, yb in loader:
        loss = F.cross_entropy(ddp(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
    last = torch.tensor([loss.item()])
    dist.all_reduce(last)  # last step's loss summed over the ranks, for the run summary


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    shared = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    path = os.path.join(shared[0], "pretrained.pt")
    if rank == 0:
        pretrain(path)
    dist.barrier()
    finetune(rank, path)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(shared[0], ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
