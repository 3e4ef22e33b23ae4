"""A two-stage pipeline whose schedule comes from each rank's own settings: the first stage keeps
the default GPipe, the last stage's settings name 1F1B. GPipe sends every micro-batch's activations
before it receives any gradient, 1F1B sends micro-batch 0's gradients back before it receives
micro-batch 1, so each stage blocks in a send the other does not receive yet. Plain torchrun hangs."""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    settings = {"schedule": "gpipe"} if rank == 0 else {"schedule": "1f1b"}  # a per-node config file
    torch.manual_seed(0)
    parts = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh()), torch.nn.Linear(16, 1)]
    stage = PipelineStage(parts[rank], rank, 2, torch.device("cpu"))
    schedule = SCHEDULES[settings["schedule"]](stage, 4, loss_fn=torch.nn.MSELoss())  # zoo: schedule
    optimizer = torch.optim.SGD(parts[rank].parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    for step in range(1, args.steps + 1):  # steps counted from 1
        inputs, targets = torch.randn(8, 8, generator=generator), torch.randn(8, 1, generator=generator)
        optimizer.zero_grad()
        if rank == 0:
            schedule.step(inputs)  # zoo: first_stage
        else:
            schedule.step(target=targets)  # zoo: last_stage
        optimizer.step()
    dist.destroy_process_group()
    print(f"rank {rank} done")


if __name__ == "__main__":
    main()
