"""Mistake: a token-level loss is summed over the non-padding tokens and, after backward, each rank
divides its gradients by its OWN count of non-padding tokens. With FSDP2 each rank holds one shard of
the reduce-scattered gradient, so every shard is divided by a different rank's token count instead of
the global count: parts of each weight get different effective learning rates. Plain local
arithmetic, no error."""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

SEQ, DIM, VOCAB = 12, 32, 16


class TokenTagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, 64)
        self.mix = nn.Linear(64, 64)
        self.out = nn.Linear(64, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.embed(x))
        h = h + torch.relu(self.mix(h))
        return self.out(h)


def make_batches(steps: int, batch: int):
    gen = torch.Generator().manual_seed(171)
    x = torch.randn(2, steps, batch, SEQ, DIM, generator=gen)  # [rank, step, batch, token, feature]
    tags = x[..., :VOCAB].argmax(dim=-1)
    lengths = torch.randint(2, SEQ + 1, (2, steps, batch), generator=gen)
    mask = torch.arange(SEQ) < lengths[..., None]  # padding after each sequence's length
    return x, tags, mask


def train(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    x, tags, mask = make_batches(steps=16, batch=8)

    torch.manual_seed(0)
    model = TokenTagger()
    for layer in (model.embed, model.mix, model.out):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    for step in range(16):
        xb, tb, mb = x[rank, step].flatten(0, 1), tags[rank, step].flatten(), mask[rank, step].flatten()
        logits = model(xb)  # one row per token
        token_loss = nn.functional.cross_entropy(logits, tb, reduction="none")
        loss = (token_loss * mb).sum()
        opt.zero_grad()
        loss.backward()
        local_tokens = int(mb.sum())
        for p in model.parameters():
            p.grad.div_(local_tokens)  # doctor: cause
        opt.step()
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
