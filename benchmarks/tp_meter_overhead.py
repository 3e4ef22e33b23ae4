"""What metering tensor parallelism's exchanges costs, measured side by side.

Tensor parallelism's activation exchanges are DTensor functional collectives, which gradsync
counts and times with a dispatch mode active from each micro-step's forward to the end of its
backward (gradsync.parallel.tp.ExchangeMeter). A dispatch mode sees every op, so it costs some
Python per op; the trainer therefore meters a sample of the steps (SampledExchanges). This
trains the bench GPT under parallel="tp" and times blocks of steps three ways in the same run:
the meter on every step, the trainer's sampling, and no meter at all (the same trainer, the
meter swapped for a no-op), alternating blocks so that machine noise hits all alike. Reports
the ratios of median step times to the unmetered one. Run with
`make bench-tp-meter` or:

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/tp_meter_overhead.py
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

import gradsync
from gradsync.bench.workloads import WORKLOADS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=12, help="alternating blocks of steps per variant")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per block")
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    workload = WORKLOADS["gpt"]
    trainer = gradsync.setup(parallel="tp", seed=0, metrics={"progress": False, "tensorboard": False, "log_every": 1000})
    model = workload.build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    steps_needed = 3 * args.blocks * args.steps + 2
    dataset = workload.build_dataset(steps_needed * args.batch_size)
    model, optimizer, loader = trainer.prepare(model, optimizer, dataset, batch_size=args.batch_size, shuffle=False)
    strategy = trainer._strategy
    sampled = strategy.micro_step
    variants = {
        "every step": lambda synced: strategy.exchanges.meter,
        "sampled": sampled,
        "unmetered": lambda synced: contextlib.nullcontext(),  # the meter's place, empty
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    batches = iter(loader)
    for epoch in trainer.epochs(1):
        for x, y in batches:  # warm-up step
            with trainer.step() as step:
                step.backward(workload.loss(model, (x, y)))
            break
        for block in range(3 * args.blocks):
            variant = order[block % 3]
            strategy.micro_step = variants[variant]
            for _ in range(args.steps):
                x, y = next(batches)
                started = time.perf_counter()
                with trainer.step() as step:
                    step.backward(workload.loss(model, (x, y)))
                times[variant].append(time.perf_counter() - started)
        for _ in batches:  # the rest of the epoch, untimed
            pass
    strategy.micro_step = sampled
    if trainer.is_main:
        medians = {variant: statistics.median(values) for variant, values in times.items()}
        base = medians["unmetered"]
        print(f"tensor parallel over {trainer.world_size} ranks, GPT batch {args.batch_size}: median step "
              f"{base * 1000:.1f} ms unmetered; metered on every step {medians['every step'] * 1000:.1f} ms "
              f"(ratio {medians['every step'] / base:.3f}); sampled as the trainer does {medians['sampled'] * 1000:.1f} ms "
              f"(ratio {medians['sampled'] / base:.3f})")
    trainer.close()


if __name__ == "__main__":
    main()
