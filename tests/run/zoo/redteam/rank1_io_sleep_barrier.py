"""Rank 1 sleeps 8 s once (waiting for a file to land) before a barrier. HEALTHY.

Mechanism (h): rank 1 is the "staging" rank. It waits a fixed 8 s for its
dataset copy to settle on the shared filesystem (one time.sleep(8): no CPU, no
collective, no stack movement) while rank 0 waits in dist.barrier(). Then both
train a few steps and exit 0.

Drawn from: https://github.com/Lightning-AI/pytorch-lightning/issues/17733
("Utility to let rank 0 do work while other ranks wait": `if rank == 0:
download; barrier()`) and https://github.com/mosaicml/composer/pull/1201 (one
rank downloads, the others wait in dist.barrier()).
"""
import os
import time

import torch
import torch.distributed as dist

STAGING_RANK = 1


def stage_dataset():
    print("staging: waiting for the NFS copy to settle", flush=True)
    time.sleep(8)  # zoo: io-sleep


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    if rank == STAGING_RANK:
        stage_dataset()
    dist.barrier()  # zoo: peer-wait
    torch.manual_seed(rank)
    emb = torch.nn.EmbeddingBag(50, 8, mode="mean")
    clf = torch.nn.Linear(8, 2)
    params = list(emb.parameters()) + list(clf.parameters())
    for p in params:
        dist.broadcast(p.data, 0)
    opt = torch.optim.Adagrad(params, lr=0.1)
    for step in range(20):
        idx = torch.randint(0, 50, (16, 5))
        y = (idx.float().mean(1) > 25).long()
        loss = torch.nn.functional.cross_entropy(clf(emb(idx)), y)
        opt.zero_grad()
        loss.backward()
        for p in params:
            dist.all_reduce(p.grad)
            p.grad.div_(dist.get_world_size())
        opt.step()
    print(f"rank {rank}: loss {loss.item():.3f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
