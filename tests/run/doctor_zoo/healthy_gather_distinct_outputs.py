"""Healthy: the contrastive loss all-gathers the embeddings into
`[torch.zeros_like(k) for _ in range(world_size)]`, one distinct buffer per rank, so every slot holds
its own rank's features. The per-rank loss/accuracy stats are gathered in place with
`all_gather_into_tensor(out, chunk)` where `chunk` is this rank's own slice of `out`, which is the
documented in-place form. Looks like the aliased-gather mistake, but every output is distinct."""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.net(x), dim=-1)


def info_nce(q: torch.Tensor, k: torch.Tensor, rank: int, world_size: int):
    gathered = [torch.zeros_like(k) for _ in range(world_size)]
    dist.all_gather(gathered, k.detach())  # doctor: lookalike
    gathered[rank] = k  # keep the local slice in the graph
    all_k = torch.cat(gathered)
    logits = q @ all_k.t() / 0.1
    labels = torch.arange(q.shape[0]) + rank * q.shape[0]
    acc = (logits.argmax(dim=1) == labels).float().mean()
    return F.cross_entropy(logits, labels), acc


def train(rank: int, world_size: int) -> None:
    gen = torch.Generator().manual_seed(61)
    data = torch.randn(world_size, 20, 16, 32, generator=gen)  # [rank, step, batch, feature]
    noise = torch.Generator().manual_seed(62 + rank)

    torch.manual_seed(0)
    ddp = DDP(Encoder())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    history = []
    for step in range(20):
        x = data[rank, step]
        view_a = x + 0.1 * torch.randn(x.shape, generator=noise)
        view_b = x + 0.1 * torch.randn(x.shape, generator=noise)
        q, k = ddp(torch.cat([view_a, view_b])).chunk(2)
        loss, acc = info_nce(q, k, rank, world_size)
        opt.zero_grad()
        loss.backward()
        opt.step()
        stats = torch.zeros(world_size * 2)
        chunk = stats.chunk(world_size)[rank]
        chunk.copy_(torch.stack([loss.detach(), acc]))
        dist.all_gather_into_tensor(stats, chunk)
        history.append(stats.view(world_size, 2).mean(dim=0))
    last = torch.tensor([loss.item()])
    dist.all_reduce(last)  # last step's loss summed over the ranks, for the run summary


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    train(rank, dist.get_world_size())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
