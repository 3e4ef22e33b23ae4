"""What each gradient compressor, and periodic synchronisation, costs in accuracy: the digits
demo trained once per setting.

Every run has the same seed, data, schedule and number of epochs (so the same samples); only
`ddp.compression` or `ddp.periodic` changes. It prints the final test accuracy and loss of each
next to fp32 (`none`) and draws the loss curves side by side.

Run with `make bench-compression-accuracy` or `python benchmarks/compression_accuracy.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# name -> the demo's options
SETTINGS = {
    **{name: ["--compression", name] for name in ("none", "fp16", "bf16", "int8", "topk", "powersgd")},
    **{f"{method}-{every}": ["--periodic-every", str(every), "--periodic-method", method]
       for method in ("average", "diloco") for every in (4, 16)},
}


def train(options: list[str], run_dir: Path, epochs: int) -> list[dict]:
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "gradsync.demo.digits",
         *options, "--epochs", str(epochs), "--run-dir", str(run_dir)],
        check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--plot", default="docs/compression-accuracy.png")
    args = parser.parse_args()
    curves, accuracy = {}, {}
    with tempfile.TemporaryDirectory() as scratch:
        for name, options in SETTINGS.items():
            rows = train(options, Path(scratch) / name, args.epochs)
            curves[name] = [(r["step"], r["loss"]) for r in rows if "loss" in r]
            accuracy[name] = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r][-1]
            print(f"{name:>10}: test accuracy {100 * accuracy[name]:.2f}% ({100 * (accuracy[name] - accuracy['none']):+.2f} "
                  f"points vs fp32), final train loss {curves[name][-1][1]:.4f}", flush=True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name, curve in curves.items():
        axes.plot(*zip(*curve), label=f"{name} ({100 * accuracy[name]:.1f}%)")
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("training loss")
    axes.set_yscale("log")
    axes.set_title(f"digits CNN, 2 workers, {args.epochs} epochs (legend: test accuracy)")
    axes.legend()
    figure.tight_layout()
    Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.plot, dpi=100)
    print(f"loss curves: {args.plot}")


if __name__ == "__main__":
    main()
