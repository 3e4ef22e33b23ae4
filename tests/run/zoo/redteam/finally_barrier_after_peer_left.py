"""Rank 0's checkpoint helper has `finally: dist.barrier()`; rank 1 already left.

Mechanism (f): a collective run by one rank after the others have left.
`save_checkpoint` is only called on rank 0, and its `finally:` block runs a
"best-effort" barrier so that "nobody exits before the file is written".
Rank 1 never calls it: it calls dist.destroy_process_group() and its process
ends. Rank 0's barrier then has no partner; Gloo reports the closed connection,
the helper swallows it with a warning, and rank 0 exits 0 as well.

Expected: "warning: collective after peer left, rank 0, line finally-barrier".

Drawn from: https://github.com/pytorch/torchtitan/pull/1342 (collective
clean-up in a `finally:` while other ranks are elsewhere "will cause
deadlock") and https://github.com/ai2cm/ace/pull/1067 (a barrier in
shutdown() "causes surviving ranks to hang indefinitely when a peer has
already exited").
"""
import os
import tempfile
import time
import warnings

import torch
import torch.distributed as dist


def save_checkpoint(model, path):
    try:
        time.sleep(1.0)  # slow shared filesystem
        torch.save(model.state_dict(), path)
    finally:
        try:
            dist.barrier()  # zoo: finally-barrier
        except RuntimeError as err:
            warnings.warn(f"checkpoint barrier failed: {err}")


def train(model, rank):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(10):
        x = torch.randn(16, 6)
        loss = (model(x) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)  # zoo: last-matched
        opt.step()


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 6)
    train(model, rank)
    if rank == 0:
        with tempfile.TemporaryDirectory() as d:
            save_checkpoint(model, os.path.join(d, "last.pt"))
    else:
        dist.destroy_process_group()  # zoo: peer-left
        print(f"rank {rank}: done", flush=True)
        return
    print(f"rank {rank}: checkpoint written", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
