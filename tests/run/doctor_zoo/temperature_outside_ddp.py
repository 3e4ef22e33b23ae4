"""Mistake: the CLIP-style learnable temperature `logit_scale` is an nn.Parameter created beside the
model, not inside it, and handed to the optimizer as `list(ddp.parameters()) + [logit_scale]`. DDP only
averages the gradients of the module it wraps, so each rank steps logit_scale with its own local
gradient and the copies drift apart. Nothing errors: the optimizer updates it as usual."""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class DualEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.image = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
        self.text = nn.Sequential(nn.Linear(24, 64), nn.ReLU(), nn.Linear(64, 16))

    def forward(self, img: torch.Tensor, txt: torch.Tensor):
        return F.normalize(self.image(img), dim=-1), F.normalize(self.text(txt), dim=-1)


def train(rank: int) -> None:
    gen = torch.Generator().manual_seed(101)
    proj = torch.randn(32, 24, generator=gen)
    images = torch.randn(2, 20, 16, 32, generator=gen)  # [rank, step, batch, feature]
    texts = images @ proj + 0.3 * torch.randn(2, 20, 16, 24, generator=gen)

    torch.manual_seed(0)
    ddp = DDP(DualEncoder())
    logit_scale = nn.Parameter(torch.ones([]) * 2.6)  # doctor: cause
    opt = torch.optim.AdamW(list(ddp.parameters()) + [logit_scale], lr=2e-3, weight_decay=0.0)
    labels = torch.arange(16)
    for step in range(20):
        img_emb, txt_emb = ddp(images[rank, step], texts[rank, step])
        logits = logit_scale.exp() * img_emb @ txt_emb.t()
        loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            logit_scale.clamp_(0, 4.6052)
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
