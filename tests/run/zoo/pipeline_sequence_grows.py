"""A two-stage pipeline over sequences (torch.distributed.pipelining, GPipe): each batch is padded
to its longest sequence, so the sequence length changes from batch to batch. The stages inferred
their messages' shapes from the first batch (length 6) and fixed the receive buffers to them; at
step 3 the batch is 9 long, the first stage sends float32[2, 9, 16] where the last stage posted
room for float32[2, 6, 16], and Gloo aborts the last stage (SIGABRT, "Received data size doesn't
match expected size"). Plain torchrun: rank 1 killed by SIGABRT, rank 0 "Connection reset"."""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

LENGTHS = [6, 6, 9, 7]  # each batch's longest sequence


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    parts = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh()), torch.nn.Linear(16, 1)]
    stage = PipelineStage(parts[rank], rank, 2, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, 4, loss_fn=torch.nn.MSELoss())
    optimizer = torch.optim.SGD(parts[rank].parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    for step, length in enumerate(LENGTHS, 1):  # steps counted from 1
        inputs = torch.randn(8, length, 8, generator=generator)  # padded to the batch's longest  # zoo: batch
        targets = torch.randn(8, length, 1, generator=generator)
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
