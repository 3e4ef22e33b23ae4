"""`gradsync demo`: the main job, a small CNN trained on scikit-learn's digits by 2 processes.

It runs under `gradsync run`, so the demo gets what a real job gets: a diagnosis of any hang or
crash, restarts (--max-restarts) and failures to rehearse them with (--inject-fault). Metrics
and the diagnosis share one run directory (metrics.jsonl, tensorboard/ next to diagnosis.json
and workers/).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gradsync import extras
from gradsync.checkpoint.store import MANIFEST, checkpoint_dirs
from gradsync.comm import COMPRESSIONS
from gradsync.errors import ConfigError
from gradsync.run import faults, launcher
from gradsync.rundir import RunDir, fresh

WORKER_MODULE = "gradsync.demo.digits"
# Demo options passed on to the worker module as given, when set (the same --names there).
WORKER_OPTIONS = (
    "epochs",
    "batch_size",
    "accumulation_steps",
    "precision",
    "compression",
    "checkpoint_dir",
    "resume",
    "checkpoint_every",
    "parallel",
)
WORKER_FLAGS = ("overwrite",)
DEMO_STRATEGIES = ("ddp", "fsdp", "tp", "pp")  # the 2-D meshes need 4 ranks and a size per dimension


def _at_least(minimum: int):
    """An argparse type for a whole number of at least `minimum`, refused at the command line."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value}: give at least {minimum}")
        return value

    return parse


def _fault(text: str) -> str:
    try:
        return str(faults.parse_fault(text))
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "demo",
        help="train a small CNN on the handwritten digits with several processes",
        description="Train a small CNN on scikit-learn's handwritten digits (no download) with "
        "data parallelism over Gloo (CPU) or NCCL (GPU), and report accuracy, throughput and "
        "the share of step time spent in exposed gradient communication.",
    )
    parser.add_argument("--nproc-per-node", type=_at_least(1), default=2, help="worker processes (default 2)")
    parser.add_argument("--run-dir", default=None, help="where metrics and the diagnosis go (default gradsync_runs/demo-<time>)")
    parser.add_argument("--epochs", type=_at_least(1), default=None, help="training epochs")
    parser.add_argument("--batch-size", type=_at_least(1), default=None, help="samples per rank per micro-step")
    parser.add_argument("--accumulation-steps", type=_at_least(1), default=None, help="micro-steps per optimizer step")
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=None)
    parser.add_argument("--compression", choices=COMPRESSIONS, default=None, help="gradient compression")
    parser.add_argument(
        "--parallel", choices=DEMO_STRATEGIES, default=None,
        help="ddp (default), fsdp (FSDP2, every layer sharded), tp (the classifier split column/row-wise) or pp "
        "(the CNN cut into one pipeline stage per process, up to 4)",
    )
    parser.add_argument("--checkpoint-dir", default=None, help="where checkpoints go")
    parser.add_argument("--resume", choices=("auto",), default=None, help="auto: continue from the latest checkpoint, if any")
    parser.add_argument("--overwrite", action="store_true", help="delete the checkpoints an earlier run left in --checkpoint-dir")
    parser.add_argument("--checkpoint-every", type=_at_least(1), default=None, metavar="N", help="save a checkpoint every N optimizer steps")
    parser.add_argument(
        "--profile-steps", default="20:22", metavar="A:B",
        help="optimizer steps recorded with torch.profiler for the report's step breakdown (default 20:22; "
        "'none' to skip)",
    )
    parser.add_argument(
        "--max-restarts", type=_at_least(0), default=0, metavar="K", help="restart all workers up to K times after a failure (default 0)"
    )
    parser.add_argument(
        "--inject-fault",
        action="append",
        default=[],
        type=_fault,
        metavar="SPEC",
        help="rehearse a failure, e.g. kill:rank=1:step=5 (see gradsync run -h; repeatable)",
    )
    parser.set_defaults(run=run)


def launcher_argv(args: argparse.Namespace, run_dir: Path) -> list[str]:
    """The `gradsync run` command line that runs the demo's workers."""
    argv = ["--standalone", "--nproc-per-node", str(args.nproc_per_node), "--run-dir", str(run_dir)]
    argv += ["--max-restarts", str(args.max_restarts)]
    if args.profile_steps not in (None, "none"):
        argv += ["--profile-steps", args.profile_steps]
    for spec in args.inject_fault:
        argv += ["--inject-fault", spec]
    argv += ["-m", WORKER_MODULE]  # the trainer inherits --run-dir from gradsync run
    for option in WORKER_OPTIONS:
        value = getattr(args, option)
        if value is not None:
            argv += [f"--{option.replace('_', '-')}", str(value)]
    argv += [f"--{flag}" for flag in WORKER_FLAGS if getattr(args, flag)]
    return argv


def run(args: argparse.Namespace) -> int:
    problem = _refused(args)
    if problem is not None:
        print(f"gradsync demo: {problem}", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir) if args.run_dir else fresh("demo-")
    print(f"gradsync demo: watch it from another shell: gradsync status --watch {run_dir}", flush=True)
    code = launcher.main(launcher_argv(args, run_dir))
    if RunDir(run_dir).metrics.is_file():
        from gradsync.report import write_report  # matplotlib: only once training is over

        page = write_report(run_dir)[0]  # gradsync run has printed the advice it holds
        print(f"report: {page} (open it in a browser; `gradsync report RUN_DIR` draws it for any run)")
    return code


def _refused(args: argparse.Namespace) -> str | None:
    """What stops the demo before any worker starts, in the demo's own option names."""
    for module, purpose in (("sklearn", "the demo loads its data"), ("matplotlib", "the demo's report draws its figures")):
        if (missing := extras.missing(module, purpose)) is not None:
            return missing
    if args.checkpoint_dir is None:
        if args.resume or args.overwrite or args.checkpoint_every:
            return "--resume, --overwrite and --checkpoint-every need --checkpoint-dir (where checkpoints go)"
        return None
    committed = [step for step, path in checkpoint_dirs(Path(args.checkpoint_dir)) if (path / MANIFEST).exists()]
    if committed and args.resume is None and not args.overwrite:
        return (f"--checkpoint-dir {args.checkpoint_dir} already holds checkpoints of an earlier run (newest: step "
                f"{committed[0]}): add --resume auto to continue it, --overwrite to delete them, or give another "
                "--checkpoint-dir")
    return None
