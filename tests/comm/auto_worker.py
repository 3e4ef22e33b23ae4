"""A torchrun worker for tests/comm/test_auto_on_links.py: train with compression='auto', then
check one step of the chosen compressor's gradients against the exact mean; report both."""

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

import gradsync
from gradsync.distributed import end_process

BATCHES = 48  # per rank and epoch: auto decides after 36 steps, and 12 batches are left to show its accumulation
BATCH_SIZE = 16


def make_model() -> torch.nn.Module:
    """Many gradient bytes for little compute, so that on a slow link the outcome does not turn on the CPU's load.

    At 20 Mbit/s its 2.8 MB of fp32 gradients take about 1.1 s a step, bf16's half 0.56 s,
    int8's quarter 0.28 s and PowerSGD's factors (2% of the bytes) 0.02 s, while the CPU's
    work of a step (forward, backward, codecs) is tens of milliseconds. Measured beside a
    whole-suite run (load average 13 on 2 cores): fp32 1233 ms a step (96% exposed), bf16 626,
    int8 338, PowerSGD 117. For int8 to come within the 2% tie of PowerSGD, PowerSGD's step
    would have to grow by 220 ms more than int8's, i.e. the CPU slow down another eightfold or
    more; bf16 or fp32 would need more still. (The convolutional model used before, 0.6 MB of
    gradients for ~0.3 s of compute, left fp32 a third of its step exposed: a few-fold slowdown
    brought that near the 10% margin.)
    """
    return torch.nn.Sequential(
        torch.nn.Linear(128, 768), torch.nn.ReLU(), torch.nn.Linear(768, 768), torch.nn.ReLU(), torch.nn.Linear(768, 10),
    )


def gradient_errors(trainer: gradsync.Trainer, model: torch.nn.Module) -> dict[str, float]:
    """One backward through DDP with the hook auto settled on, against the exact mean of every
    rank's own gradients (all-reduced separately, in fp32): the relative error of the
    matrices' gradients, and the largest of the vectors' (sent uncompressed by every compressor).

    The chosen hook's carried state (error feedback's residuals, int8's agreed scales,
    PowerSGD's factors) is cleared first, through the state a checkpoint without it would
    load: what the compressors document is the error of a step without carried error (the
    first-step bounds in tests/comm/test_compression.py); what error feedback carries is sent
    in later steps, which a single step cannot show.
    """
    module = trainer.unwrap(model)
    generator = torch.Generator().manual_seed(1000 + trainer.rank)
    x, y = torch.randn(BATCH_SIZE, 128, generator=generator), torch.randint(0, 10, (BATCH_SIZE,), generator=generator)
    parameters = list(module.parameters())
    exact = torch.autograd.grad(torch.nn.functional.cross_entropy(module(x), y), parameters)
    for gradient in exact:
        dist.all_reduce(gradient)
        gradient.div_(trainer.world_size)
    hook = trainer._strategy.compression.current
    hook.load_state_dict({**hook.state_dict(), "parameters": {}})
    for parameter in parameters:
        parameter.grad = None
    torch.nn.functional.cross_entropy(model(x), y).backward()
    matrices = [(p.grad, g) for p, g in zip(parameters, exact) if p.dim() > 1]
    vectors = [(p.grad, g) for p, g in zip(parameters, exact) if p.dim() <= 1]

    def relative(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        applied, true = torch.cat([a.reshape(-1) for a, _ in pairs]), torch.cat([t.reshape(-1) for _, t in pairs])
        return float((applied - true).norm() / true.norm())

    return {"matrix_error": relative(matrices), "vector_error": max(relative([pair]) for pair in vectors)}


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
    model = make_model()
    samples = BATCHES * BATCH_SIZE * trainer.world_size
    data = torch.utils.data.TensorDataset(torch.randn(samples, 128), torch.randint(0, 10, (samples,)))
    model, optimizer, loader = trainer.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01), data, batch_size=BATCH_SIZE)
    for _ in trainer.epochs(1):
        for x, y in loader:
            with trainer.step() as step:
                step.backward(torch.nn.functional.cross_entropy(model(x), y))
    errors = gradient_errors(trainer, model)
    if trainer.is_main:
        gradient_bytes = sum(p.numel() * p.element_size() for p in trainer.unwrap(model).parameters())
        Path(args.result).write_text(json.dumps({"auto": trainer.summary()["auto"], "gradient_bytes": gradient_bytes, **errors}))
    trainer.close()
    end_process(0)


if __name__ == "__main__":
    main()
