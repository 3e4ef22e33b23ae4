"""A small CNN on the handwritten digits that ship with scikit-learn, trained with gradsync.

Run it through the launcher (`gradsync demo`, or `torchrun -m gradsync.demo.digits`), or alone
with `python -m gradsync.demo.digits`: the same script works at any world size. Read it top to
bottom as an example of the library's API.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import gradsync
from gradsync.checkpoint import parameters_sha256
from gradsync.distributed import end_process


def digits_datasets(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """1,797 8x8 grey images of digits, split 80/20 with every class in both parts."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    images, labels = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=0.2, stratify=labels, random_state=seed
    )

    def as_dataset(x, y) -> TensorDataset:
        pixels = torch.tensor(x, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
        return TensorDataset(pixels, torch.tensor(y, dtype=torch.long))

    return as_dataset(x_train, y_train), as_dataset(x_test, y_test)


class DigitsCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Dropout(0.25), nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


@torch.no_grad()
def test_accuracy(trainer: gradsync.Trainer, model: nn.Module, test_set: TensorDataset) -> float:
    """Accuracy over the whole test set: each rank scores its share, then the counts are summed."""
    # DDP: the plain module, so evaluation runs no collective per batch. FSDP, tensor parallelism
    # and pipelines: the spread model, whose forwards every rank runs (eval_loader gives each as many).
    net = trainer.unwrap(model)
    net.eval()
    correct = total = 0
    for x, y in trainer.eval_loader(test_set, batch_size=256):
        correct += (net(x).argmax(dim=1) == y).sum().item()
        total += len(y)
    net.train()
    correct, total = trainer.sum_over_ranks(correct, total)
    return correct / total


# Where the CNN's pipeline stages begin, by the number of stages: the convolutions and the
# first Linear layer hold nearly all the work, so they go to different stages first.
PIPELINE_SPLITS = {1: (), 2: ("classifier",), 3: ("features.3", "classifier"), 4: ("features.3", "classifier", "classifier.4")}


def _parallel(strategy: str) -> dict:
    """The CNN has no transformer block for the standard tensor-parallel plan: its classifier's
    two Linear layers are split column-wise then row-wise, the convolutions stay replicated.
    A pipeline puts one stage on each process (torchrun's WORLD_SIZE)."""
    if strategy == "tp":
        return {"strategy": "tp", "tp_plan": {"classifier.2": "colwise", "classifier.4": "rowwise"}}
    if strategy == "pp":
        stages = int(os.environ.get("WORLD_SIZE", "1"))
        if stages not in PIPELINE_SPLITS:
            raise SystemExit(f"the demo's pipeline cuts the CNN into at most 4 stages, one per process; got {stages} processes")
        return {"strategy": "pp", "split_points": PIPELINE_SPLITS[stages]}
    return {"strategy": strategy}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--accumulation-steps", type=int, default=2)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--compression", default="none", help="gradient compression (see gradsync.comm)")
    parser.add_argument("--parallel", default="ddp", help="ddp, fsdp, tp or pp (see gradsync.parallel)")
    parser.add_argument("--periodic-every", type=int, default=1,
                        help="optimizer steps each rank takes alone between agreements (1: DDP's all-reduce every step)")
    parser.add_argument("--periodic-method", default="average", help="average or diloco (see gradsync.comm.periodic)")
    parser.add_argument("--run-dir", default=None)
    parser.add_argument("--checkpoint-dir", default=None, help="save checkpoints here (off by default)")
    parser.add_argument("--checkpoint-every", type=int, default=10, help="optimizer steps between checkpoints")
    parser.add_argument("--resume", choices=("auto",), default=None, help="continue from the newest valid checkpoint")
    parser.add_argument("--overwrite", action="store_true", help="delete an earlier run's checkpoints first")
    args = parser.parse_args(argv)
    checkpoint = (
        {"dir": args.checkpoint_dir, "every_steps": args.checkpoint_every, "resume": args.resume,
         "overwrite": args.overwrite}
        if args.checkpoint_dir
        else {}
    )
    started = time.perf_counter()

    trainer = gradsync.setup(
        accumulation_steps=args.accumulation_steps,
        precision=args.precision,
        max_grad_norm=1.0,
        seed=0,
        run_dir=args.run_dir,
        ddp={"compression": args.compression, "periodic": {"every": args.periodic_every, "method": args.periodic_method}},
        checkpoint=checkpoint,
        parallel=_parallel(args.parallel),
    )
    train_set, test_set = digits_datasets(seed=0)
    model = DigitsCNN().to(trainer.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    model, optimizer, loader = trainer.prepare(model, optimizer, train_set, batch_size=args.batch_size)
    resumed = f"{trainer.resumed_from} (step {trainer.optimizer_steps})" if trainer.resumed_from else None
    trainer.set_scheduler(
        torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=args.lr, total_steps=args.epochs * trainer.steps_per_epoch
        )
    )

    accuracy = None
    for epoch in trainer.epochs(args.epochs):
        for x, y in loader:
            with trainer.step() as step:
                # model(x), the loss and its backward: one call that pipelines ("pp") need too
                loss = step.forward_backward(x, y, F.cross_entropy)
            trainer.log(loss=loss)
        accuracy = test_accuracy(trainer, model, test_set)
        trainer.log({"eval/accuracy": accuracy})

    if accuracy is None:  # resumed from the checkpoint of a run that had finished: nothing left to train
        accuracy = test_accuracy(trainer, model, test_set)
    summary = trainer.summary()
    params_sha256 = parameters_sha256(trainer.unwrap(model))
    trainer.close()
    if trainer.is_main:
        print_summary(summary, accuracy, time.perf_counter() - started, trainer.run_dir, params_sha256,
                      resumed)


def print_summary(summary: dict, accuracy: float, wall_s: float, run_dir, params_sha256: str, resumed: str | None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="gradsync demo: digits CNN")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("test accuracy", f"{100 * accuracy:.2f}%")
    table.add_row("final train loss", f"{summary['loss']:.4f}")
    table.add_row("processes", str(summary["world_size"]))
    table.add_row("optimizer steps", f"{summary['steps']} ({summary['skipped_steps']} skipped)")
    table.add_row("samples/s (all ranks)", f"{summary['samples_per_s']:.0f}")
    table.add_row("exposed communication", f"{100 * summary['exposed_comm_share']:.1f}% of step time")
    table.add_row("wall time", f"{wall_s:.1f} s" + (" (this attempt)" if resumed else ""))
    Console().print(table)
    # Plain prints: rich would wrap a long path in the middle, and these are meant to be copied.
    if resumed is not None:
        print(f"resumed from {resumed}")
    print(f"metrics: {run_dir}/metrics.jsonl")
    print(f"tensorboard --logdir {run_dir}")
    # Equal hashes mean bitwise-equal models: an interrupted and resumed demo ends where an
    # uninterrupted one does.
    print(f"params sha256: {params_sha256}")


if __name__ == "__main__":
    main()
    end_process(0)
