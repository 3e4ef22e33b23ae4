"""Healthy training written with gradsync (setup, prepare, epochs, step, close): a tiny model on a
small synthetic TensorDataset for 2 epochs. Exits 0 on every rank; metrics go to a temporary run dir."""

import argparse
import os
import shutil
import tempfile

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import gradsync


def default_run_dir() -> str:
    # gradsync checks that every rank got the same options, run_dir included, so the directory
    # must be named the same on every rank: derive it from the launcher's run id (one per launch).
    run_id = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("MASTER_PORT") or str(os.getpid())
    return os.path.join(tempfile.gettempdir(), f"gradsync_zoo_{run_id}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--run-dir", default=None, help="keep metrics here (default: a temporary dir, removed)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    run_dir = args.run_dir or default_run_dir()
    trainer = gradsync.setup(seed=0, run_dir=run_dir, metrics={"progress": False})  # zoo: setup
    gen = torch.Generator().manual_seed(0)
    train_set = TensorDataset(torch.randn(256, 16, generator=gen), torch.randn(256, 1, generator=gen))
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).to(trainer.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, loader = trainer.prepare(model, optimizer, train_set, batch_size=16)  # zoo: prepare

    for epoch in trainer.epochs(args.epochs):
        for x, y in loader:
            with trainer.step() as step:
                loss = F.mse_loss(model(x), y)
                step.backward(loss)  # zoo: backward
            trainer.log(loss=loss)

    summary = trainer.summary()
    trainer.close()  # zoo: close
    if trainer.is_main:
        print(f"steps {summary['steps']} last loss {summary['loss']:.4f}", flush=True)
        if args.run_dir is None:
            shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
