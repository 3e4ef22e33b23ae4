"""A torchrun worker for tests/comm/test_auto_on_links.py: train with compression='auto', report the choice."""

import argparse
import json
from pathlib import Path

import torch

import gradsync
from gradsync.distributed import end_process


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--result", required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--max-accumulation", type=int, default=1)
    args = parser.parse_args()
    trainer = gradsync.setup(
        ddp={"compression": {"name": "auto", "max_accumulation_steps": args.max_accumulation}},
        run_dir=args.run_dir, metrics={"progress": False, "tensorboard": False},
    )
    torch.manual_seed(0)
    # Compute-heavy for its gradient size (0.6 MB): convolutions over 32x32 images.
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 48, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(48, 96, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(96, 96, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        torch.nn.Linear(96, 10),
    )
    data = torch.utils.data.TensorDataset(torch.randn(40 * 16 * trainer.world_size, 3, 32, 32), torch.randint(0, 10, (40 * 16 * trainer.world_size,)))
    model, optimizer, loader = trainer.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01), data, batch_size=16)
    for _ in trainer.epochs(1):
        for x, y in loader:
            with trainer.step() as step:
                step.backward(torch.nn.functional.cross_entropy(model(x), y))
    if trainer.is_main:
        Path(args.result).write_text(json.dumps(trainer.summary()["auto"]))
    trainer.close()
    end_process(0)


if __name__ == "__main__":
    main()
