"""Healthy: rank 0 alone validates every 4 steps (model.eval(), then model.train() again), logs the
learning rate and saves the model to its own checkpoint path; every rank clips its gradients and steps
its scheduler, and every rank saves its own state to a per-rank file (state_rank{rank}.pt). The blocks'
ModuleDict is built from sorted() names, the same order on every rank. Nothing to report."""

import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

BLOCK_NAMES = {"embed", "mix", "gate", "proj"}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({name: nn.Linear(16, 16) for name in sorted(BLOCK_NAMES)})
        self.dropout = nn.Dropout(0.2)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks.values():
            x = x + torch.tanh(block(x))
        return self.head(self.dropout(x))


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    shared = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    ckpt_dir = shared[0]
    gen = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(256, 16, generator=gen), torch.randn(256, 1, generator=gen))
    val_x, val_y = torch.randn(64, 16, generator=gen), torch.randn(64, 1, generator=gen)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)  # 128 samples, 8 batches per rank
    loader = DataLoader(dataset, batch_size=16, sampler=sampler)

    torch.manual_seed(0)
    model = Net()
    ddp = DDP(model)
    torch.manual_seed(1000 + rank)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    scheduler = StepLR(opt, step_size=4, gamma=0.5)
    history = []
    step = 0
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm=0.1)
            opt.step()
            scheduler.step()
            step += 1
            if rank == 0:
                history.append((step, loss.item(), scheduler.get_last_lr()[0]))
            if rank == 0 and step % 4 == 0:
                model.eval()
                with torch.no_grad():
                    val_loss = F.mse_loss(model(val_x), val_y).item()
                model.train()
                torch.save(model.state_dict(), os.path.join(ckpt_dir, "model.pt"))
            if step % 4 == 0:
                torch.save({"opt": opt.state_dict(), "rng": torch.get_rng_state()},
                           os.path.join(ckpt_dir, f"state_rank{rank}.pt"))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
