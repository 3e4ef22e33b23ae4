"""Two-stage run: pretrain a backbone on a regression task, then fine-tune it for classification."""
import argparse
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


def make_tasks(n=1536, dim=32, seed=17):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    proj = torch.randn(dim, 8, generator=g)
    feats = torch.tanh(x @ proj)
    y_reg = feats.sum(dim=1, keepdim=True)
    y_cls = feats[:, :4].argmax(dim=1)
    return TensorDataset(x, y_reg), TensorDataset(x, y_cls)


class Net(nn.Module):
    def __init__(self, dim=32, hidden=128, out=1):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, out)

    def forward(self, x):
        return self.head(self.backbone(x))


def loader_for(dataset, rank, world_size, batch_size):
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)
    return sampler, DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)


def run_epochs(model, optimizer, sampler, loader, epochs, loss_fn, rank, tag):
    step = 0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = loss_fn(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if rank == 0 and step % 8 == 0:
                print(f"[{tag}] epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pretrain-epochs", type=int, default=1)
    parser.add_argument("--finetune-epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)

    workdir = [tempfile.mkdtemp(prefix="pretrain_") if rank == 0 else None]
    dist.broadcast_object_list(workdir, src=0)
    ckpt_path = os.path.join(workdir[0], "pretrained.pt")
    reg_set, cls_set = make_tasks()

    # ---- stage 1: pretraining ----
    model = DDP(Net(out=1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    sampler, loader = loader_for(reg_set, rank, world_size, args.batch_size)
    run_epochs(model, optimizer, sampler, loader, args.pretrain_epochs, F.mse_loss, rank, "pretrain")
    if rank == 0:
        torch.save(model.state_dict(), ckpt_path)
    dist.barrier()

    # ---- stage 2: fine-tuning with a new classification head ----
    net = Net(out=4)
    state = torch.load(ckpt_path, map_location="cpu")
    net.load_state_dict(state, strict=False)  # the head has a different shape, so skip it
    model = DDP(net)
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-4)
    sampler, loader = loader_for(cls_set, rank, world_size, args.batch_size)
    run_epochs(model, optimizer, sampler, loader, args.finetune_epochs, F.cross_entropy, rank, "finetune")

    dist.barrier()
    if rank == 0:
        shutil.rmtree(workdir[0], ignore_errors=True)
    del model, optimizer
    dist.destroy_process_group()
    time.sleep(0.5)  # let gloo's background threads wind down before the interpreter exits


if __name__ == "__main__":
    main()
