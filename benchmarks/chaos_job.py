"""The job `make chaos` breaks: the digits demo's CNN and data, trained by gradsync's trainer with
checkpoints, as a user's job would be (`benchmarks/chaos.py` runs it under `gradsync run`).

Two things only a benchmark needs: rank 0 writes the optimizer step it has reached to
`--progress` after every step (so the harness can strike at a chosen step from outside: cut a
host's link, fill the disk), and it prints the final parameters' SHA-256, which the harness
compares with an uninterrupted run's. `make slurm-check` runs it through deploy/slurm/train.sbatch,
which passes `--resume auto`; there `--step-pause-s` keeps the job running until Slurm's time-limit
notice arrives, without changing what it computes.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import gradsync
from gradsync.checkpoint import parameters_sha256
from gradsync.demo.digits import DigitsCNN, digits_datasets
from gradsync.distributed import end_process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--every", type=int, default=4, help="optimizer steps between checkpoints")
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--progress", default=None, help="file where rank 0 writes the step it reached")
    parser.add_argument("--resume", default="auto", help="gradsync's checkpoint resume setting")
    parser.add_argument("--step-pause-s", type=float, default=0.0, help="seconds every rank sleeps after each optimizer step")
    args = parser.parse_args()
    checkpoint = {"dir": args.checkpoint_dir, "every_steps": args.every, "async_save": args.async_save, "resume": args.resume}
    trainer = gradsync.setup(
        accumulation_steps=2, max_grad_norm=1.0, seed=0,
        checkpoint=checkpoint if args.checkpoint_dir else {},
        metrics={"progress": False, "tensorboard": False},
    )
    train_set, _ = digits_datasets(seed=0)
    model = DigitsCNN().to(trainer.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    model, optimizer, loader = trainer.prepare(model, optimizer, train_set, batch_size=32)
    trainer.set_scheduler(torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=args.epochs * trainer.steps_per_epoch))
    for _ in trainer.epochs(args.epochs):
        for x, y in loader:
            with trainer.step() as step:
                step.backward(F.cross_entropy(model(x), y))
            if step.is_boundary and args.progress and trainer.is_main:
                _write_progress(Path(args.progress), trainer.optimizer_steps)
            if step.is_boundary and args.step_pause_s:
                time.sleep(args.step_pause_s)
    sha = parameters_sha256(trainer.unwrap(model))
    trainer.close()
    if trainer.is_main:
        print(f"params sha256: {sha}", flush=True)


def _write_progress(path: Path, step: int) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(str(step))
    os.replace(temporary, path)


if __name__ == "__main__":
    main()
    end_process(0)
