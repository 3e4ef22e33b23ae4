"""`gradsync demo`: the main job, a small CNN trained on scikit-learn's digits by 2 processes."""

from __future__ import annotations

import argparse
import importlib.util
import sys

from gradsync.cli.launch import launch_module
from gradsync.comm import COMPRESSIONS
from gradsync.rundir import fresh_run_dir


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "demo",
        help="train a small CNN on the handwritten digits with several processes",
        description="Train a small CNN on scikit-learn's handwritten digits (no download) with "
        "data parallelism over Gloo (CPU) or NCCL (GPU), and report accuracy, throughput and "
        "the share of step time spent in exposed gradient communication.",
    )
    parser.add_argument("--nproc-per-node", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--run-dir", default=None, help="where metrics go (default gradsync_runs/demo-<time>)")
    parser.add_argument("--epochs", type=int, default=None, help="training epochs")
    parser.add_argument("--batch-size", type=int, default=None, help="samples per rank per micro-step")
    parser.add_argument("--accumulation-steps", type=int, default=None, help="micro-steps per optimizer step")
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=None)
    parser.add_argument("--compression", choices=COMPRESSIONS, default=None, help="gradient compression")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.nproc_per_node < 1:
        print("gradsync demo: --nproc-per-node must be at least 1", file=sys.stderr)
        return 2
    if importlib.util.find_spec("sklearn") is None:
        print(
            "gradsync demo: the demo's data ships with scikit-learn, which is not installed; "
            "install it with: pip install 'gradsync[demo]'",
            file=sys.stderr,
        )
        return 2
    worker_args = ["--run-dir", str(args.run_dir or fresh_run_dir("demo-"))]
    for option in ("epochs", "batch_size", "accumulation_steps", "precision", "compression"):
        value = getattr(args, option)
        if value is not None:
            worker_args += [f"--{option.replace('_', '-')}", str(value)]
    return launch_module("gradsync.demo.digits", worker_args, args.nproc_per_node)
