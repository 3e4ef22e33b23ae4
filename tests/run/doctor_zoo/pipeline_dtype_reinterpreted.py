"""A two-stage pipeline (torch.distributed.pipelining, 1F1B) whose stages were given their message
shapes by hand (input_args/output_args, which skips torch's shape inference): the first stage
sends its activations in bfloat16 to halve the traffic, but the second stage's example input was
made with .half(), so it receives them into float16 buffers. Same byte count: no error, the loss
goes on, and the last stage trains on bfloat16 bits read as float16 (the gradients sent back
likewise). Runs to the end on every rank."""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

MICROBATCH = 2


class SendBf16(torch.nn.Module):
    """The first stage: its output crosses the link in bfloat16."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.layer(x)).to(torch.bfloat16)


class Head(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x.float())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    if rank == 0:
        module = SendBf16()
        stage = PipelineStage(module, 0, 2, torch.device("cpu"), input_args=torch.zeros(MICROBATCH, 8),
                              output_args=torch.zeros(MICROBATCH, 16, dtype=torch.bfloat16),
                              output_grads=torch.zeros(MICROBATCH, 16, dtype=torch.bfloat16))
    else:
        module = Head()
        received = torch.zeros(MICROBATCH, 16).half()  # doctor: received
        stage = PipelineStage(module, 1, 2, torch.device("cpu"), input_args=received, output_args=torch.zeros(MICROBATCH, 1),
                              input_grads=torch.zeros_like(received))
    schedule = Schedule1F1B(stage, 4, loss_fn=torch.nn.MSELoss())
    optimizer = torch.optim.SGD(module.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for step in range(1, args.steps + 1):  # steps counted from 1
        inputs, targets = torch.randn(4 * MICROBATCH, 8, generator=generator), torch.randn(4 * MICROBATCH, 1, generator=generator)
        optimizer.zero_grad()
        if rank == 0:
            schedule.step(inputs)  # doctor: first_stage
        else:
            schedule.step(target=targets, losses=losses)  # doctor: last_stage
        optimizer.step()
    dist.destroy_process_group()
    if rank == 1:
        print(f"last loss {sum(l.item() for l in losses[-4:]) / 4:.4f}")
    print(f"rank {rank} done")


if __name__ == "__main__":
    main()
