"""Healthy: a model wrapped in DDP (with a comm hook of the script's own) and its optimizer, saved
whole as users do: `pickle.dumps(ddp)`, `torch.save(ddp)` and `torch.save(optimizer)` into memory,
loaded back and used. Under plain torchrun every one succeeds, and the pickled sizes and the loaded
copy's output are the same on every rank and in every run; a launcher's bookkeeping on the user's
objects would change them (or fail). Prints them, and the loss of each step."""

import io
import os
import pickle

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

STEPS = 14


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    gen = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(512, 16, generator=gen), torch.randn(512, 1, generator=gen))
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=16, sampler=sampler)
    probe = torch.randn(4, 16, generator=gen)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    ddp = DDP(model)
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    step = 0
    for x, y in loader:
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        print(f"rank {rank} step {step}: loss {loss.item():.6f}")
        if step in (2, 9):
            pickled = pickle.dumps(ddp)  # doctor: lookalike
            saved, optimizer_saved = io.BytesIO(), io.BytesIO()
            torch.save(ddp, saved)
            torch.save(opt, optimizer_saved)
            saved.seek(0)
            copy_ = torch.load(saved, weights_only=False)
            with torch.no_grad():
                out = copy_.module(probe).sum().item()
            print(f"rank {rank} step {step}: pickled {len(pickled)} bytes, saved {len(saved.getvalue())} bytes, "
                  f"optimizer {len(optimizer_saved.getvalue())} bytes, loaded copy's output {out:.6f}, "
                  f"state_dict keys {sorted(ddp.state_dict())}")
        if step == STEPS:
            break
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
