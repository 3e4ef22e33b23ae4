"""Healthy: the CLIP-style learnable temperature `logit_scale` is an nn.Parameter created inside the
model's __init__, so it is one of the DDP-wrapped module's parameters: DDP broadcasts it at
construction and averages its gradient every step like any weight, and the optimizer gets it through
`ddp.parameters()`. Looks like a loose temperature parameter, but it stays identical on every rank."""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Clip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.image = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
        self.text = nn.Sequential(nn.Linear(24, 64), nn.ReLU(), nn.Linear(64, 16))
        self.logit_scale = nn.Parameter(torch.ones([]) * 2.6)  # doctor: lookalike

    def forward(self, img: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
        img_emb = F.normalize(self.image(img), dim=-1)
        txt_emb = F.normalize(self.text(txt), dim=-1)
        return self.logit_scale.exp() * img_emb @ txt_emb.t()


def train(rank: int) -> None:
    gen = torch.Generator().manual_seed(121)
    proj = torch.randn(32, 24, generator=gen)
    images = torch.randn(2, 20, 16, 32, generator=gen)  # [rank, step, batch, feature]
    texts = images @ proj + 0.3 * torch.randn(2, 20, 16, 24, generator=gen)

    torch.manual_seed(0)
    model = Clip()
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=2e-3, weight_decay=0.0)
    labels = torch.arange(16)
    for step in range(20):
        logits = ddp(images[rank, step], texts[rank, step])
        loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0, 4.6052)
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
