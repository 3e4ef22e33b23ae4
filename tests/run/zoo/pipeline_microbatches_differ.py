"""A two-stage pipeline (torch.distributed.pipelining, 1F1B) whose stages compute their
micro-batch count from their own share of the memory budget: the last stage, holding the bigger
head, halves its micro-batches' size and so builds its schedule for 8 micro-batches, while the
first builds it for 4. The last stage waits for micro-batch 4's activations, which the first never
sends; the first waits for gradients the last never sends back. Plain torchrun hangs."""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

BATCH = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    parts = [torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU()), torch.nn.Linear(32, 10)]
    stage = PipelineStage(parts[rank], rank, 2, torch.device("cpu"))
    microbatch_size = 4 if rank == 0 else 2  # what fits this stage's memory  # zoo: size
    schedule = Schedule1F1B(stage, BATCH // microbatch_size, loss_fn=torch.nn.CrossEntropyLoss())  # zoo: schedule
    optimizer = torch.optim.AdamW(parts[rank].parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    for step in range(1, args.steps + 1):  # steps counted from 1
        inputs = torch.randn(BATCH, 8, generator=generator)
        targets = torch.randint(0, 10, (BATCH,), generator=generator)
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
