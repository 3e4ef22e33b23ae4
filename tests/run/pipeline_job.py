"""A two-stage pipeline (torch.distributed.pipelining, GPipe) over 2 ranks, healthy unless
`--mismatch`: then the last stage is built for 8 micro-batches while the first sends 4, so the
last waits for micro-batch 4's activations, which never come, while the first waits for
micro-batch 0's gradients (GPipe runs every forward before any backward)."""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mismatch", action="store_true")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh()), torch.nn.Linear(16, 1)]
    stage = PipelineStage(layers[rank], rank, 2, torch.device("cpu"))
    microbatches = 8 if args.mismatch and rank == 1 else 4
    schedule = ScheduleGPipe(stage, microbatches, loss_fn=lambda output, target: ((output - target.mean()) ** 2).mean())
    optimizer = torch.optim.SGD(layers[rank].parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    for _ in range(args.steps):
        x, y = torch.randn(8, 8, generator=generator), torch.randn(8, 1, generator=generator)
        optimizer.zero_grad()
        if rank == 0:
            schedule.step(x)  # the first stage feeds the inputs
        else:
            schedule.step(target=y)  # the last computes the loss
        optimizer.step()
    dist.destroy_process_group()
    print(f"rank {rank} done")


if __name__ == "__main__":
    main()
