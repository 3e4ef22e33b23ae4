"""FSDP2 training of a small MLP. At the end of every epoch the main process
writes a consolidated (full) state dict to disk for downstream evaluation."""
import datetime
import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard


def build_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def save_full(model, path, rank):
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    sd = get_model_state_dict(model, options=opts)
    if rank == 0:
        torch.save(sd, path)


def train(rank):
    model = build_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    out_dir = tempfile.mkdtemp(prefix="fsdp_ckpt_")
    g = torch.Generator().manual_seed(rank)
    for epoch in range(3):
        for _ in range(5):
            x = torch.randn(16, 24, generator=g)
            loss = nn.functional.cross_entropy(model(x), x[:, :4].argmax(1))
            opt.zero_grad()
            loss.backward()
            opt.step()
        save_full(model, os.path.join(out_dir, f"epoch{epoch}.pt"), rank)
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f} saved", flush=True)
        dist.barrier()


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    train(dist.get_rank())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
