"""gradsync's own pp+ddp on 4 ranks: 2 stages x 2 replicas (each stage in a DDP over its
replicas), 1F1B. With `--drift`, rank 2 (stage 0's second replica) nudges one of its stage's
weights after the first optimizer step, outside the optimizer: stage 0's replicas diverge."""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import gradsync


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--drift", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    trainer = gradsync.setup(seed=0, parallel={"strategy": "pp+ddp", "pp_size": 2, "schedule": "1f1b", "split_points": ["2"]},
                             metrics={"progress": False, "tensorboard": False})
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 1))
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(64, 6, generator=generator)
    data = TensorDataset(x, torch.sin(x.sum(1, keepdim=True)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, loader = trainer.prepare(model, optimizer, data, batch_size=8)
    for _ in trainer.epochs(1):
        for inputs, targets in loader:
            with trainer.step() as step:
                step.forward_backward(inputs, targets, F.mse_loss)
            if args.drift and trainer.rank == 2 and trainer.optimizer_steps == 1:
                with torch.no_grad():
                    next(model.shard.parameters()).add_(0.01)  # this replica only  # doctor: drift
    trainer.close()


if __name__ == "__main__":
    main()
