"""A healthy two-stage pipeline (torch.distributed.pipelining): 1F1B with 4 micro-batches for
three steps, then GPipe with 2 for two more (a schedule may change between steps, on every stage
alike), then an evaluation pass without gradients through the same stages. Exits 0 on every rank."""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    parts = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh()), torch.nn.Linear(16, 1)]
    optimizer = torch.optim.SGD(parts[rank].parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for step in range(1, args.steps + 1):  # steps counted from 1
        if step in (1, 4):  # a new stage and schedule: 1F1B first, GPipe from step 4
            stage = PipelineStage(parts[rank], rank, 2, torch.device("cpu"))
            schedule = (Schedule1F1B(stage, 4, loss_fn=torch.nn.MSELoss()) if step == 1
                        else ScheduleGPipe(stage, 2, loss_fn=torch.nn.MSELoss()))
        inputs, targets = torch.randn(8, 8, generator=generator), torch.randn(8, 1, generator=generator)
        optimizer.zero_grad()
        if rank == 0:
            schedule.step(inputs)  # zoo: first_stage
        else:
            schedule.step(target=targets, losses=losses)  # zoo: last_stage
        optimizer.step()
    dist.destroy_process_group()
    if rank == 1:
        print(f"last loss {sum(losses[-2:]).item() / 2:.4f}")
    print(f"rank {rank} done")


if __name__ == "__main__":
    main()
