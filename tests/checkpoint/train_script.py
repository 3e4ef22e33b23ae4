"""A small but complete training run for checkpoint tests: dropout, accumulation with a short
last window, AdamW, a one-cycle schedule, checkpoints every few steps.

Run as a script under a launcher (`gradsync run ... train_script.py --checkpoint-dir D`) or call
`train()` from the test harness. It writes the SHA-256 of its final parameters and the samples
each rank saw to --out.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import gradsync
from gradsync.checkpoint import parameters_sha256

SAMPLES = 120


class IndexedData(Dataset):
    """Synthetic regression samples that also say which sample they are."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randn(SAMPLES, 8, generator=generator)
        self.y = self.x @ torch.randn(8, 1, generator=generator)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int):
        return self.x[index], self.y[index], index


class StepCounter:
    """A user's own object with state, saved with each checkpoint by register_for_checkpointing."""

    def __init__(self) -> None:
        self.steps = 0

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]


def train(
    checkpoint_dir: str | None = None,
    *,
    epochs: int = 4,
    every_steps: int | None = 3,
    every_minutes: float | None = None,
    resume: str | None = "auto",
    async_save: bool = False,
    stop_after_step: int | None = None,
    run_dir: str | None = None,
    step_delay_s: float = 0.0,
    hidden: int = 64,
    overwrite: bool = False,
    ballast: str | None = None,
    seen_log: str | None = None,
    one_cycle: bool = True,
    parallel: str | dict = "ddp",  # a strategy's name, or its options
) -> dict:
    checkpoint = {"dir": checkpoint_dir, "every_steps": every_steps, "every_minutes": every_minutes, "resume": resume,
                  "async_save": async_save, "overwrite": overwrite} if checkpoint_dir else {}
    trainer = gradsync.setup(
        accumulation_steps=2,
        seed=3,
        run_dir=run_dir,
        checkpoint=checkpoint,
        metrics={"log_every": 4, "progress": False, "tensorboard": False},
        # Tensor parallelism splits the hidden layer: the first Linear by columns, the last by rows.
        parallel=parallel if isinstance(parallel, dict) else {
            "strategy": parallel, **({"tp_plan": {"0": "colwise", "3": "rowwise"}} if "tp" in parallel else {}),
            **({"tp_size": 2} if parallel == "fsdp+tp" else {}), **({"shard_size": 2} if parallel == "hsdp" else {})},
    )
    warnings = _collect_warnings()  # after setup, which installs gradsync's own console handler first
    model = nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Dropout(0.3), nn.Linear(hidden, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = trainer.prepare(model, optimizer, IndexedData(), batch_size=8)
    if one_cycle:
        trainer.set_scheduler(torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=epochs * trainer.steps_per_epoch))
    counter = StepCounter()
    trainer.register_for_checkpointing(counter=counter)
    seen: dict[int, list[int]] = {}
    # Every micro-batch with the optimizer step it belongs to, appended as it is taken: what a
    # process saw survives it being killed, so a test can check an epoch across restarts.
    log = open(Path(seen_log) / f"{os.getpid()}.jsonl", "a") if seen_log else None
    for epoch in trainer.epochs(epochs):
        for x, y, index in loader:
            seen.setdefault(epoch, []).extend(index.tolist())
            if log is not None:
                log.write(json.dumps({"epoch": epoch, "step": trainer.optimizer_steps + 1, "world_size": trainer.world_size,
                                      "indices": index.tolist()}) + "\n")
                log.flush()
            with trainer.step() as step:
                step.forward_backward(x, y, F.mse_loss)
            trainer.log(loss=0.0)
            counter.steps += step.stepped
            if ballast and trainer.is_main and os.path.exists(ballast) and any("could not be written" in w for w in warnings):
                os.unlink(ballast)  # once a save failed for want of space, the disk has room again
            if step_delay_s:
                import time

                time.sleep(step_delay_s)
            if stop_after_step is not None and trainer.optimizer_steps >= stop_after_step and step.stepped:
                break
        if stop_after_step is not None and trainer.optimizer_steps >= stop_after_step:
            break
    result = {"sha256": parameters_sha256(trainer.unwrap(model)), "steps": trainer.optimizer_steps, "seen": seen,
              "summary_steps": trainer.summary()["steps"], "counter": counter.steps,
              "saves": trainer.summary()["checkpoints_saved"], "warnings": warnings}
    trainer.close()
    return result


def _collect_warnings() -> list[str]:
    """gradsync's warnings from here on, for the test to read (the harness keeps only results)."""
    import logging

    collected: list[str] = []

    class Collector(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                collected.append(record.getMessage())

    logging.getLogger("gradsync").addHandler(Collector())
    return collected


def train_expecting_error(**options) -> dict:
    """`train`, returning the gradsync error it raises instead of failing the worker."""
    try:
        return {"result": train(**options)}
    except gradsync.GradsyncError as error:
        return {"error": f"{type(error).__name__}: {error}"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint-dir")
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--every-steps", type=int, default=3)
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--step-delay", type=float, default=0.0)
    parser.add_argument("--seen-log", default=None, help="folder where each process logs the samples it takes")
    parser.add_argument("--constant-lr", action="store_true", help="no one-cycle schedule (its length depends on the world size)")
    args = parser.parse_args()
    result = train(args.checkpoint_dir, epochs=args.epochs, every_steps=args.every_steps, async_save=args.async_save,
                   step_delay_s=args.step_delay, seen_log=args.seen_log, one_cycle=not args.constant_lr)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
    from gradsync.distributed import end_process

    end_process(0)
