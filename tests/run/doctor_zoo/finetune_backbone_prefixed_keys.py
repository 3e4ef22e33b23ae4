"""Mistake: the "pretrained" encoder weights are saved from an autoencoder whose encoder is the
attribute `encoder` (keys `encoder.0.weight`, ...), then loaded with
`model.backbone.load_state_dict(state, strict=False)` into a Sequential whose keys are `0.weight`, ...
The prefix never matches, strict=False swallows the mismatch, and fine-tuning silently starts from
random backbone weights."""

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


def encoder() -> nn.Sequential:
    return nn.Sequential(nn.Linear(24, 48), nn.ReLU(), nn.Linear(48, 32), nn.ReLU())


class AutoEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = encoder()
        self.decoder = nn.Linear(32, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


class Classifier(nn.Module):
    def __init__(self, classes: int) -> None:
        super().__init__()
        self.backbone = encoder()
        self.head = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def pretrain(path: str) -> None:
    # stands in for an earlier self-supervised job
    gen = torch.Generator().manual_seed(81)
    x = torch.randn(256, 24, generator=gen)
    torch.manual_seed(0)
    ae = AutoEncoder()
    opt = torch.optim.Adam(ae.parameters(), lr=1e-2)
    for i in range(8):
        xb = x[i * 32:(i + 1) * 32]
        opt.zero_grad()
        F.mse_loss(ae(xb), xb).backward()
        opt.step()
    torch.save({k: v for k, v in ae.state_dict().items() if k.startswith("encoder.")}, path)


def finetune(rank: int, path: str) -> None:
    gen = torch.Generator().manual_seed(82)
    x = torch.randn(512, 24, generator=gen)
    y = (x[:, :3].sum(dim=1) > 0).long() + (x[:, 3] > 0.5).long()
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)  # 256 samples, 16 batches per rank
    loader = DataLoader(dataset, batch_size=16, sampler=sampler)

    torch.manual_seed(1)
    model = Classifier(classes=3)
    state = torch.load(path)
    model.backbone.load_state_dict(state, strict=False)  # doctor: cause
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
    path = os.path.join(shared[0], "encoder_pretrained.pt")
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
