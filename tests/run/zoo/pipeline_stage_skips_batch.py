"""A two-stage pipeline (torch.distributed.pipelining, GPipe, 4 micro-batches): rank 0 holds the
embedding-like first stage, rank 1 the head and the loss. The last stage alone sees the targets,
and at step 3 it finds them all masked out and skips the batch; the first stage trains on it. Their
messages pair by order, so from then on the head meets the next batch's activations with this
batch's targets, and after the last batch the first stage waits for gradients that never come
while the last stage has finished. Plain torchrun: rank 0 fails with "Connection reset by peer"."""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

IGNORE = -100


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    parts = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU()), torch.nn.Linear(16, 4)]
    stage = PipelineStage(parts[rank], rank, 2, torch.device("cpu"))
    loss_fn = torch.nn.CrossEntropyLoss(ignore_index=IGNORE)
    schedule = ScheduleGPipe(stage, 4, loss_fn=loss_fn)
    optimizer = torch.optim.SGD(parts[rank].parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    for step in range(1, args.steps + 1):  # steps counted from 1
        inputs = torch.randn(8, 8, generator=generator)
        targets = torch.randint(0, 4, (8,), generator=generator)
        if step == 3:
            targets[:] = IGNORE  # a batch of padding only
        if rank == 1 and (targets == IGNORE).all():
            continue  # nothing to learn from: only this stage knows it  # zoo: skip
        optimizer.zero_grad()
        if rank == 0:
            schedule.step(inputs)  # zoo: first_stage
        else:
            schedule.step(target=targets)  # zoo: last_stage
        optimizer.step()
    dist.destroy_process_group()
    print(f"rank {rank} trained {args.steps} steps")


if __name__ == "__main__":
    main()
