"""A plain PyTorch classifier trained with Hugging Face Accelerate, as its docs show it.

Launched by `torchrun --nproc-per-node 2` (or `gradsync run ...`, or `accelerate launch`):
Accelerator() picks up the launcher's environment and joins a Gloo group on CPU.
Uses prepare, accumulate (gradient accumulation with no_sync), backward, clip_grad_norm_,
gather_for_metrics in evaluation, wait_for_everyone and save_state.

`--bug barrier_rank0` puts `wait_for_everyone()` inside `if accelerator.is_main_process:`
(a barrier only rank 0 calls): the job hangs after the last epoch.
"""

import argparse
import shutil
import tempfile

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def make_data(n: int, seed: int) -> TensorDataset:
    w = torch.randn(32, 4, generator=torch.Generator().manual_seed(1234))  # one labelling for train and eval
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=gen)
    y = (x @ w + 0.3 * torch.randn(n, 4, generator=gen)).argmax(dim=1)
    return TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--num-workers", type=int, default=2, help="DataLoader worker processes")
    parser.add_argument("--bug", choices=["none", "barrier_rank0"], default="none")
    args = parser.parse_args()

    torch.set_num_threads(1)
    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True)
    set_seed(0)

    train_loader = DataLoader(make_data(2048, 0), batch_size=16, shuffle=True, num_workers=args.num_workers,
                              persistent_workers=args.num_workers > 0)
    # 500 samples do not split evenly over 2 ranks x 32: gather_for_metrics drops Accelerate's padding
    eval_loader = DataLoader(make_data(500, 1), batch_size=32, num_workers=args.num_workers)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 128), nn.ReLU(),
                          nn.Linear(128, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_loader))
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler)

    for epoch in range(args.epochs):
        model.train()
        total, count = 0.0, 0
        for x, y in train_loader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            total, count = total + loss.item(), count + 1

        model.eval()
        correct, seen = 0, 0
        with torch.no_grad():
            for x, y in eval_loader:
                pred = model(x).argmax(dim=1)
                pred, y = accelerator.gather_for_metrics((pred, y))
                correct, seen = correct + (pred == y).sum().item(), seen + len(y)
        mean_loss = accelerator.reduce(torch.tensor(total / count), reduction="mean").item()
        accelerator.print(f"epoch {epoch}: train loss {mean_loss:.4f}, eval acc {correct / seen:.4f} "
                          f"({seen} samples)")

    if args.bug == "barrier_rank0":
        if accelerator.is_main_process:
            accelerator.wait_for_everyone()  # BUG: only rank 0 reaches this barrier
    else:
        accelerator.wait_for_everyone()
    out = tempfile.mkdtemp(prefix="compat_accel_") if accelerator.is_main_process else None
    out = broadcast_object_list([out])[0]  # rank 0's folder on every rank
    accelerator.save_state(out)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(out, ignore_errors=True)
    accelerator.print(f"final: train loss {mean_loss:.4f}, eval acc {correct / seen:.4f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
