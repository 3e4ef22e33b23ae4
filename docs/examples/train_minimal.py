"""A complete gradsync training script: synthetic data (no download), a small MLP, gradient
accumulation, mixed precision on GPUs, evaluation, and checkpoints with automatic resume.
The same file runs alone or under any launcher:

    python docs/examples/train_minimal.py
    torchrun --standalone --nproc-per-node 2 docs/examples/train_minimal.py
    gradsync run --standalone --nproc-per-node 2 docs/examples/train_minimal.py --checkpoint-dir /tmp/ckpt
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import gradsync


def synthetic(n: int, seed: int) -> TensorDataset:
    """n samples of 32 features; the label is the largest of 4 fixed linear scores."""
    x = torch.randn(n, 32, generator=torch.Generator().manual_seed(seed))
    w = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, (x @ w).argmax(dim=1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--checkpoint-dir", default=None, help="save every 50 steps and resume from here")
    args = parser.parse_args()

    trainer = gradsync.setup(
        accumulation_steps=2,                                    # one all-reduce per 2 micro-batches
        precision="bf16" if torch.cuda.is_available() else "fp32",
        max_grad_norm=1.0,
        seed=0,
        checkpoint={"dir": args.checkpoint_dir, "every_steps": 50, "resume": "auto"} if args.checkpoint_dir else {},
    )
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 4)).to(trainer.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    train_set, val_set = synthetic(4096, seed=1), synthetic(1024, seed=2)
    model, optimizer, loader = trainer.prepare(model, optimizer, train_set, batch_size=64)
    trainer.set_scheduler(
        torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * trainer.steps_per_epoch)
    )

    for epoch in trainer.epochs(args.epochs):
        for x, y in loader:                                      # this rank's batches, on its device
            with trainer.step() as step:
                loss = F.cross_entropy(model(x), y)
                step.backward(loss)                              # the optimizer steps at the window's end
            trainer.log(loss=loss)

        net = trainer.unwrap(model).eval()                       # plain module: no collective per batch
        correct = total = 0
        with torch.no_grad():
            for x, y in trainer.eval_loader(val_set, batch_size=256):  # every sample once across ranks
                correct += (net(x).argmax(dim=1) == y).sum().item()
                total += len(y)
        net.train()
        correct, total = trainer.sum_over_ranks(correct, total)
        trainer.log({"eval/accuracy": correct / total})
        if trainer.is_main:
            print(f"epoch {epoch}: validation accuracy {correct / total:.3f}")

    summary = trainer.summary()                                  # the same on every rank
    trainer.close()
    if trainer.is_main:
        print(f"{summary['steps']} optimizer steps, {summary['samples_per_s']:.0f} samples/s; metrics: {trainer.run_dir}")


if __name__ == "__main__":
    main()
