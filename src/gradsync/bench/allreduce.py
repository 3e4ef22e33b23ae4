"""`gradsync bench allreduce`: an nccl-tests-style all-reduce sweep on whatever backend is in use.

For each message size it reports time, algorithm bandwidth (bytes / time) and bus bandwidth
(algbw * 2(n-1)/n for all-reduce, the figure comparable with the link's rate whatever the world
size, as in nccl-tests). It runs as a torchrun worker: `gradsync bench allreduce` starts local
workers itself, and the same module runs under any launcher across hosts
(`torchrun ... -m gradsync.bench.allreduce --json`).

Every rank runs the same number of iterations (rank 0 decides from a timed warm-up and tells the
others), and a size's time is the slowest rank's mean: a collective is as slow as its last rank.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gradsync.distributed import collective_device, end_process, join_process_group, plan_distributed, shutdown
from gradsync.errors import ConfigError
from gradsync.metrics.timing import bus_factor, synchronized_time

DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int32": torch.int32, "int8": torch.int8,
}
OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "prod": dist.ReduceOp.PRODUCT}
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text: str) -> int:
    """'1K', '256M', '4096' -> bytes (binary units, as nccl-tests)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?)(?:i?b)?\s*", text.lower())
    if match is None or float(match[1]) * _UNITS[match[2]] < 1:
        raise ConfigError(f"size {text!r}: use a positive number of bytes with an optional K, M or G suffix, e.g. 1K or 256M.")
    return int(float(match[1]) * _UNITS[match[2]])


@dataclass(frozen=True)
class SweepConfig:
    """One sweep: sizes from min_bytes to max_bytes, multiplied by `factor` each time."""

    min_bytes: int = 1 << 10
    max_bytes: int = 256 << 20
    factor: int = 2
    dtype: str = "float32"
    op: str = "sum"
    warmup: int = 2
    min_iters: int = 3
    max_iters: int = 50
    target_s: float = 0.25  # time spent measuring each size, roughly

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r}: use one of {', '.join(DTYPES)}.")
        if self.op not in OPS:
            raise ConfigError(f"op {self.op!r}: use one of {', '.join(OPS)} (Gloo has no 'avg').")
        if not 1 <= self.min_bytes <= self.max_bytes:
            raise ConfigError(f"sizes: need 1 <= min ({self.min_bytes}) <= max ({self.max_bytes}).")
        if self.factor < 2:
            raise ConfigError(f"factor {self.factor}: sizes grow by an integer factor >= 2.")
        if not 1 <= self.min_iters <= self.max_iters:
            raise ConfigError(f"iterations: need 1 <= min_iters ({self.min_iters}) <= max_iters ({self.max_iters}).")

    def sizes(self) -> list[int]:
        element = torch.tensor([], dtype=DTYPES[self.dtype]).element_size()
        sizes, size = [], self.min_bytes
        while size <= self.max_bytes:
            sizes.append(max(element, size - size % element))
            size *= self.factor
        return sizes


@dataclass(frozen=True)
class SizeResult:
    bytes: int
    time_s: float
    algbw_gbps: float
    busbw_gbps: float


def measure(config: SweepConfig, device: torch.device, group: Any = None) -> list[SizeResult]:
    """Run the sweep on the current process group (every rank calls it with the same config)."""
    world = dist.get_world_size(group)
    dtype, op = DTYPES[config.dtype], OPS[config.op]
    # The iteration count and the timings travel on the measured group too: on the CUDA device
    # where that group is pure NCCL, which refuses CPU tensors.
    bookkeeping = collective_device(group)
    results = []
    for size in config.sizes():
        tensor = torch.ones(size // torch.tensor([], dtype=dtype).element_size(), dtype=dtype, device=device)
        started = synchronized_time(device)
        for _ in range(config.warmup):
            dist.all_reduce(tensor, op=op, group=group)
        warm = (synchronized_time(device) - started) / max(1, config.warmup)
        # Rank 0 picks the iteration count so that every rank runs the same number of collectives.
        iterations = torch.tensor([min(config.max_iters, max(config.min_iters, int(config.target_s / max(warm, 1e-6))))],
                                  device=bookkeeping)
        dist.broadcast(iterations, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        dist.barrier(group=group)
        started = synchronized_time(device)
        for _ in range(int(iterations)):
            dist.all_reduce(tensor, op=op, group=group)
        elapsed = torch.tensor([(synchronized_time(device) - started) / int(iterations)], dtype=torch.float64,
                               device=bookkeeping)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
        seconds = float(elapsed)
        algbw = size / seconds / 1e9
        results.append(SizeResult(size, seconds, algbw, algbw * bus_factor(world)))
        del tensor
    return results



def report(world_size: int, backend: str, config: SweepConfig, results: list[SizeResult]) -> dict[str, Any]:
    return {
        "world_size": world_size,
        "backend": backend,
        "dtype": config.dtype,
        "op": config.op,
        "results": [asdict(r) for r in results],
    }


def render(data: dict[str, Any]) -> str:
    lines = [
        f"# all_reduce {data['op']} {data['dtype']}, {data['world_size']} ranks, {data['backend']}",
        f"{'size':>10} {'time (us)':>12} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13} {'busbw (Gbit/s)':>15}",
    ]
    for r in data["results"]:
        lines.append(
            f"{_human(r['bytes']):>10} {r['time_s'] * 1e6:>12.1f} {r['algbw_gbps']:>13.3f} "
            f"{r['busbw_gbps']:>13.3f} {r['busbw_gbps'] * 8:>15.2f}"
        )
    if data["results"]:
        largest = data["results"][-1]
        lines.append(f"# largest message: busbw {largest['busbw_gbps']:.3f} GB/s ({largest['busbw_gbps'] * 8:.2f} Gbit/s)")
    return "\n".join(lines)


def _human(size: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--min-bytes", "-b", default="1K", help="smallest message (default 1K)")
    parser.add_argument("--max-bytes", "-e", default="256M", help="largest message (default 256M)")
    parser.add_argument("--factor", "-f", type=int, default=2, help="size multiplier between steps (default 2)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument("--op", choices=tuple(OPS), default="sum")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default=None, help="default: nccl on GPUs, gloo on CPUs")
    parser.add_argument("--iters", type=int, default=50, help="most timed iterations per size (default 50)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--output", default=None, help="also write the JSON report to this file")
    parser.add_argument("--quiet", action="store_true", help="print nothing (with --output: for other tools)")


def sweep_config(args: argparse.Namespace) -> SweepConfig:
    return SweepConfig(
        min_bytes=parse_size(args.min_bytes), max_bytes=parse_size(args.max_bytes), factor=args.factor,
        dtype=args.dtype, op=args.op, max_iters=args.iters, min_iters=min(3, args.iters),
    )


def worker_main(argv: list[str] | None = None) -> None:
    """The per-rank entry point (under torchrun or `gradsync bench allreduce`)."""
    parser = argparse.ArgumentParser(prog="python -m gradsync.bench.allreduce", description=__doc__.splitlines()[0])
    add_sweep_arguments(parser)
    args = parser.parse_args(argv)
    try:
        config = sweep_config(args)
    except ConfigError as error:
        print(f"gradsync bench allreduce: {error}", file=sys.stderr)
        end_process(2)
    ctx = join_process_group(plan_distributed(None, args.backend), timeout_s=None)
    if not ctx.has_process_group:
        print("gradsync bench allreduce: needs several processes; run it through `gradsync bench allreduce "
              "--nproc-per-node N` or a launcher (torchrun ... -m gradsync.bench.allreduce).", file=sys.stderr)
        end_process(2)
    results = measure(config, ctx.device)
    if ctx.is_main:
        data = report(ctx.world_size, ctx.backend or "", config, results)
        if args.output:
            Path(args.output).write_text(json.dumps(data, indent=2))
        if not args.quiet:
            print(json.dumps(data) if args.json else render(data), flush=True)
    shutdown(ctx)
    end_process(0)


if __name__ == "__main__":
    worker_main()
