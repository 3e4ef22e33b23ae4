import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.out = nn.Linear(64, 3)

    def forward(self, x):
        return self.out(self.body(x))


def make_task(n, seed, shift=0.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 12, generator=g)
    logits = x[:, :3] * 2.0 + shift * x[:, 3:6]
    return TensorDataset(x, logits.argmax(1))


def run_epochs(model, optimizer, loader, sampler, epochs, rank, tag):
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        tot, n = 0.0, 0
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            tot += loss.item()
            n += 1
        if rank == 0:
            print(f"[{tag}] epoch {epoch} loss {tot / n:.4f}", flush=True)


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    torch.manual_seed(0)

    shared = [tempfile.mkdtemp(prefix="pretrain_") if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    ckpt_path = os.path.join(shared[0], "pretrained.pt")

    # ---- stage 1: pretraining on the source task ----
    src = make_task(512, seed=1)
    src_sampler = DistributedSampler(src, num_replicas=world_size, rank=rank, shuffle=True)
    src_loader = DataLoader(src, batch_size=32, sampler=src_sampler, drop_last=True)
    model = DDP(Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    run_epochs(model, optimizer, src_loader, src_sampler, 2, rank, "pretrain")
    if rank == 0:
        torch.save(model.module.state_dict(), ckpt_path)
    dist.barrier()

    # ---- stage 2: fine-tuning on the target task, starting from the pretrained weights ----
    tgt = make_task(512, seed=2, shift=0.7)
    tgt_sampler = DistributedSampler(tgt, num_replicas=world_size, rank=rank, shuffle=True)
    tgt_loader = DataLoader(tgt, batch_size=32, sampler=tgt_sampler, drop_last=True)
    net = Net()
    if rank == 0:
        state = torch.load(ckpt_path, map_location="cpu")
        net.load_state_dict(state)
        print("loaded pretrained weights", flush=True)
    model = DDP(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    run_epochs(model, optimizer, tgt_loader, tgt_sampler, 3, rank, "finetune")

    dist.barrier()
    if rank == 0:
        shutil.rmtree(shared[0], ignore_errors=True)
    dist.destroy_process_group()
    time.sleep(1)


if __name__ == "__main__":
    main()
