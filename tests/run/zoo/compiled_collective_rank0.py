"""A compiled module with a collective inside: `GlobalNorm` all-reduces its batch mean in
forward and is compiled with `torch.compile(..., backend="eager")` (not fullgraph). Training on
every rank is fine. At step 3 rank 0 alone evaluates, through the same compiled module, so its
forward all-reduces while rank 1 already waits in the `dist.barrier()` meant to wait for the
evaluation. The collective is hidden inside the compiled code; plain torchrun hangs."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class GlobalNorm(nn.Module):
    """Centres by the mean over every rank's batch (the all-reduce is inside the compiled graph)."""

    def forward(self, x):
        mean = x.mean(dim=0, keepdim=True)
        dist.all_reduce(mean)  # zoo: compiled_all_reduce
        return x - mean / dist.get_world_size()


@torch.no_grad()
def evaluate(model: nn.Module, norm: nn.Module, gen: torch.Generator) -> float:
    x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)
    return F.mse_loss(model(norm(x)), y).item()  # zoo: eval_forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--eval-every", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    ddp = DDP(model)
    norm = torch.compile(GlobalNorm(), backend="eager")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)
    for step in range(1, args.steps + 1):  # steps counted from 1
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)
        loss = F.mse_loss(ddp(norm(x)), y)
        opt.zero_grad()
        loss.backward()  # zoo: backward
        opt.step()
        if step % args.eval_every == 0:
            if rank == 0:  # only the main rank evaluates ...
                print(f"step {step}: val loss {evaluate(model, norm, gen):.4f}", flush=True)
            dist.barrier()  # zoo: barrier
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
