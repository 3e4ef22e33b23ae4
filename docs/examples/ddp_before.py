"""A typical hand-written DDP training script (the "before" of the migration guide in the README).

    torchrun --standalone --nproc-per-node 2 docs/examples/ddp_before.py
"""

import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EPOCHS, BATCH_SIZE, ACCUMULATION = 3, 64, 4


def synthetic(n: int, seed: int) -> TensorDataset:
    x = torch.randn(n, 32, generator=torch.Generator().manual_seed(seed))
    w = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, (x @ w).argmax(dim=1))


def main() -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, local_rank = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)                                          # same initial weights on every rank

    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 4)).to(device)
    model = DDP(model, device_ids=[local_rank] if cuda else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cuda", enabled=cuda)            # fp16 loss scaling on GPUs

    train_set = synthetic(4096, seed=1)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=BATCH_SIZE, sampler=sampler)

    step = 0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)                                  # forget it and every epoch has the same order
        for i, (x, y) in enumerate(loader):
            x, y = x.to(device), y.to(device)
            last = (i + 1) % ACCUMULATION == 0
            # no_sync() must cover forward *and* backward, or every micro-batch all-reduces.
            with contextlib.nullcontext() if last else model.no_sync():
                with torch.autocast(device.type, dtype=torch.float16, enabled=cuda):
                    loss = F.cross_entropy(model(x), y) / ACCUMULATION
                scaler.scale(loss).backward()
            if last:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(optimizer)                            # silently skipped on overflow
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                if rank == 0 and step % 10 == 0:
                    print(f"step {step} loss {loss.item() * ACCUMULATION:.4f}")  # rank 0's loss only
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
