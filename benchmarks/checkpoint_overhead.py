"""What checkpointing costs a training run, sync and async, as a share of its step time.

The same training (the CIFAR-shaped ResNet-18 of `gradsync bench train`, AdamW, 2 processes on
Gloo) runs with checkpoints off, saved synchronously and saved asynchronously, each saving
every `--every` optimizer steps into a fresh folder. Launches alternate (off, sync, async, then
the reverse order) so drift on a shared machine hits every mode alike. Reported per mode:

- `blocking_s_per_save`: time the training thread spent in each save (the whole write for
  sync; staging the state into memory for async);
- `overhead_share`: within each run, the mean step time over the median step time (a save is
  timed as part of the step after it; the median is a step without one), minus the same ratio
  of the runs without checkpoints: the extra step time checkpointing adds at this frequency,
  free of the launch-to-launch noise of this machine. Async writes compete for CPU and disk with
  the steps that run meanwhile, which this share includes.
- `whole_run_ratio`: total step time against the runs without checkpoints (noise included).

Run with `make bench-checkpoint-overhead` or `python benchmarks/checkpoint_overhead.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("off", "sync", "async")


def worker(args: argparse.Namespace) -> None:
    import torch

    import gradsync
    from gradsync.bench.workloads import WORKLOADS
    from gradsync.rundir import RunDir

    workload = WORKLOADS[args.workload]
    checkpoint = {}
    if args.mode != "off":
        checkpoint = {"dir": args.checkpoint_dir, "every_steps": args.every, "async_save": args.mode == "async", "keep": 2}
    trainer = gradsync.setup(seed=0, run_dir=args.run_dir, checkpoint=checkpoint,
                             metrics={"progress": False, "tensorboard": False, "log_every": 5})
    model = workload.build_model().to(trainer.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dataset = workload.build_dataset(args.batch_size * trainer.world_size * args.steps)
    model, optimizer, loader = trainer.prepare(model, optimizer, dataset, batch_size=args.batch_size)
    started = None
    for _ in trainer.epochs(1):
        for batch in loader:
            if trainer.optimizer_steps == args.warmup and started is None:
                started = time.perf_counter()
            with trainer.step() as step:
                step.backward(workload.loss(model, batch))
    elapsed = time.perf_counter() - started
    steps = trainer.optimizer_steps - args.warmup
    trainer.close()  # waits for a background save still running
    summary = trainer.summary()
    if trainer.is_main:
        rows = [json.loads(line) for line in RunDir(trainer.run_dir).metrics.read_text().splitlines()]
        step_times = [row["step_time_max_s"] for row in rows if row["step"] > args.warmup]
        result = {
            "mode": args.mode,
            "seconds": elapsed,
            "steps": steps,
            # A save runs between two steps and is timed as part of the next one.
            "mean_over_median": statistics.mean(step_times) / statistics.median(step_times),
            "saves": summary["checkpoints_saved"],
            "save_seconds": summary["checkpoint_save_s"],
            "checkpoint_mb": _size_mb(Path(args.checkpoint_dir)) / max(1, len(list(Path(args.checkpoint_dir).glob("step-*")))) if summary["checkpoints_saved"] else 0.0,
        }
        Path(args.out).write_text(json.dumps(result))


def _size_mb(root: Path) -> float:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) / 2**20


def launch(mode: str, args: argparse.Namespace, scratch: Path, round_index: int) -> dict:
    out = scratch / f"{mode}-{round_index}.json"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
        __file__, "--worker", "--mode", mode, "--out", str(out), "--workload", args.workload,
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--every", str(args.every),
        "--batch-size", str(args.batch_size), "--checkpoint-dir", str(scratch / f"ckpt-{mode}-{round_index}"),
        "--run-dir", str(scratch / f"run-{mode}-{round_index}"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // args.nproc))}
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, default="off", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint-dir", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    parser.add_argument("--workload", default="resnet18")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the timing")
    parser.add_argument("--every", type=int, default=10, help="optimizer steps between checkpoints")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        from gradsync.distributed import end_process

        end_process(0)

    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="gradsync-ckpt-bench-") as scratch:
        for round_index in range(args.rounds):
            order = MODES if round_index % 2 == 0 else tuple(reversed(MODES))
            for mode in order:
                runs[mode].append(launch(mode, args, Path(scratch), round_index))
                print(f"round {round_index + 1}/{args.rounds} {mode}: {runs[mode][-1]['seconds']:.1f} s", file=sys.stderr)
    baseline = statistics.median(r["seconds"] / r["steps"] for r in runs["off"])
    report = {"workload": args.workload, "every_steps": args.every, "world_size": args.nproc,
              "step_time_s": baseline, "modes": {}}
    plain_tail = statistics.median(r["mean_over_median"] for r in runs["off"])
    for mode in ("sync", "async"):
        step_time = statistics.median(r["seconds"] / r["steps"] for r in runs[mode])
        saves = sum(r["saves"] for r in runs[mode])
        report["modes"][mode] = {
            "overhead_share": statistics.median(r["mean_over_median"] for r in runs[mode]) - plain_tail,
            "whole_run_ratio": step_time / baseline,
            "blocking_s_per_save": sum(r["save_seconds"] for r in runs[mode]) / max(1, saves),
            "checkpoint_mb": statistics.median(r["checkpoint_mb"] for r in runs[mode]),
        }
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"{args.workload}, {args.nproc} ranks, step {baseline * 1000:.0f} ms without checkpoints, a save every {args.every} steps")
    for mode, row in report["modes"].items():
        print(
            f"  {mode:5}  {row['checkpoint_mb']:.0f} MB per checkpoint, training thread blocked "
            f"{row['blocking_s_per_save'] * 1000:.0f} ms per save ({row['blocking_s_per_save'] / baseline:.2f} steps), "
            f"overhead {100 * row['overhead_share']:+.1f}% of step time "
            f"(whole runs against runs without checkpoints: {row['whole_run_ratio']:.2f}x, launch-to-launch noise included)"
        )


if __name__ == "__main__":
    main()
