"""`gradsync bench train`: what each communication setting buys on a real training workload.

For a built-in workload it runs one worker alone (the reference), then N workers once per
configuration, each a fresh job through the launcher, then the lone worker again: the
reference is the mean of the two, so a machine that speeds up or slows down during the
benchmark does not favour the configurations measured early or late. It reports per configuration: samples/s
per worker, scaling efficiency (per-worker throughput / the lone worker's), the share of step
time spent in exposed communication, bytes sent per step, and the final loss. The global batch
is the same for every configuration (per-worker batch x N), so losses are comparable, unless
auto is allowed to raise accumulation (`--auto-max-accumulation`): then its report says what it
chose. Steps here are micro-batches (batches each worker takes), whatever the accumulation.

Configurations: fp32 or ddp (DDP's plain all-reduce), fp16, bf16, powersgd, int8, topk (gradient
compression, gradsync.comm), auto (tries them and keeps the fastest), and the other parallelism
strategies (gradsync.parallel): fsdp, hsdp (sharded within a host, replicated across), tp (tensor
parallel over every worker) and fsdp+tp (tensor parallel within a host, FSDP across). Every one
keeps the same global batch: a tensor-parallel group takes the batches of all its workers at
once. Throughput is measured after `warmup` steps; auto's warm-up includes its trials, so its
number is what it settled on. Memory per worker is reported two ways: the model state it holds
(parameters, gradients and optimizer state, its shards only under FSDP and TP) and the process's
peak resident memory (activations, buffers and the runtime included).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from gradsync.comm.auto import DECISION_STEPS
from gradsync.errors import ConfigError
from gradsync.rundir import RunDir

COMPRESSIONS = ("fp32", "fp16", "bf16", "powersgd", "int8", "topk", "auto")
STRATEGIES = ("ddp", "fsdp", "hsdp", "tp", "fsdp+tp")
CONFIGS = COMPRESSIONS + STRATEGIES
SWEEP_MAX = "64M"  # largest all-reduce in the report's bandwidth sweep
AUTO_TRIAL_STEPS = DECISION_STEPS  # steps before auto has settled, left out of every job's throughput


def compression_for(config: str) -> str:
    return "none" if config in ("fp32", *STRATEGIES) else config


def parallel_for(config: str, world: int, local_world: int) -> dict[str, Any]:
    """The strategy of a configuration; the 2-D ones split at the host (a host's workers share
    the fast links), or in halves when every worker is on one host."""
    if config not in STRATEGIES:
        return {"strategy": "ddp"}
    inner = local_world if 1 < local_world < world else max(world // 2, 1)
    return {"strategy": config, **({"shard_size": inner} if config == "hsdp" else {}),
            **({"tp_size": inner} if config == "fsdp+tp" else {})}


def traffic_bytes(row: dict[str, Any], parallel: dict[str, Any], world: int) -> float:
    """Bytes one worker sends in a step: each collective's size times nccl-tests' factor for its
    group ((n-1)/n for all-gather and reduce-scatter, 2(n-1)/n for all-reduce), so strategies
    that move different collectives compare."""
    def share(n: int) -> float:
        return (n - 1) / n if n > 1 else 0.0

    mesh = parallel.get("mesh", {})
    if parallel["strategy"] == "ddp":
        return row.get("comm_bytes", 0) * 2 * share(world)
    shard = mesh.get("shard", mesh.get("dp", 1))  # FSDP's group
    exchange = mesh.get("replicate", mesh.get("tp", 1))  # HSDP's replicas, or the tensor-parallel group
    return (row.get("all_gather_bytes", 0) + row.get("reduce_scatter_bytes", 0)) * share(shard) \
        + row.get("all_reduce_bytes", 0) * 2 * share(exchange)


def model_state_bytes(model: Any, optimizer: Any) -> int:
    """What this rank holds of the model: its parameters (local shards of DTensors), a gradient
    for each trainable one, and the optimizer's state tensors."""
    import torch
    from torch.distributed.tensor import DTensor

    def local(tensor: torch.Tensor) -> int:
        tensor = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        return tensor.numel() * tensor.element_size()

    parameters = list(model.parameters())
    state = [v for per_param in optimizer.state.values() for v in per_param.values() if isinstance(v, torch.Tensor)]
    return sum(local(p) for p in parameters) + sum(local(p) for p in parameters if p.requires_grad) + sum(local(v) for v in state)


def parse_configs(text: str) -> list[str]:
    configs = [c.strip() for c in text.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if not configs or unknown:
        raise ConfigError(f"--configs {text!r}: use a comma-separated list of {', '.join(CONFIGS)}.")
    return configs


# -- one job (runs in every worker) ---------------------------------------------------------------


def worker_main(argv: list[str] | None = None) -> None:
    import torch
    import torch.distributed as dist

    from gradsync.trainer import setup
    from gradsync.bench.workloads import WORKLOADS
    from gradsync.distributed import end_process

    parser = argparse.ArgumentParser(prog="python -m gradsync.bench.train")
    parser.add_argument("--workload", choices=tuple(WORKLOADS), required=True)
    parser.add_argument("--config", choices=CONFIGS, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--max-accumulation", type=int, default=1)
    parser.add_argument("--result", required=True)
    parser.add_argument("--run-dir", required=True)
    args = parser.parse_args(argv)

    workload = WORKLOADS[args.workload]
    auto = args.config == "auto"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    parallel = parallel_for(args.config, world, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    trainer = setup(
        ddp={
            "compression": {"name": "auto", "max_accumulation_steps": args.max_accumulation} if auto else compression_for(args.config),
            "bucket_cap_mb": "auto" if auto else 25.0,
        },
        parallel=parallel,
        run_dir=args.run_dir,
        metrics={"log_every": 5, "progress": False, "tensorboard": False},
    )
    torch.manual_seed(0)
    model = workload.build_model()
    dataset = workload.build_dataset(args.steps * args.batch_size * trainer.world_size)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=args.lr, momentum=0.9)
    # A tensor-parallel group computes one copy of the model: it takes its workers' batches together.
    group_batch = args.batch_size * (parallel.get("tp_size") or (world if parallel["strategy"] == "tp" else 1))
    model, optimizer, loader = trainer.prepare(model, optimizer, dataset, batch_size=group_batch, shuffle=False)
    step_ends: list[float] = []
    loss_value = float("nan")
    for _ in trainer.epochs(1):
        for batch in loader:
            with trainer.step() as step:
                loss = workload.loss(model, batch)
                step.backward(loss)
            trainer.log(loss=loss)
            step_ends.append(time.perf_counter())
            loss_value = loss.item()
    summary = trainer.summary()
    memory = torch.tensor([model_state_bytes(model, optimizer), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024],
                          dtype=torch.float64, device=trainer.device)
    if trainer.world_size > 1:
        dist.all_reduce(memory, op=dist.ReduceOp.MAX)
    memory = memory.cpu()
    rows = [json.loads(line) for line in RunDir(trainer.run_dir).metrics.read_text().splitlines()] if trainer.is_main else []
    chosen = summary.get("auto")
    measured = step_ends[args.warmup :]
    seconds = torch.tensor([measured[-1] - measured[0] if len(measured) > 1 else float("nan")], dtype=torch.float64)
    if trainer.world_size > 1:
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    if trainer.is_main:
        timed_steps = len(measured) - 1
        samples = timed_steps * args.batch_size  # per worker
        late = [r for r in rows if r["step"] > args.warmup]
        result = {
            "config": args.config,
            "world_size": trainer.world_size,
            "samples_per_s_per_worker": samples / float(seconds) if timed_steps > 0 else None,
            "exposed_comm_share": (
                sum(r["exposed_comm_s"] for r in late) / sum(r["step_time_s"] for r in late) if late else None
            ),
            "comm_bytes_per_step": statistics.fmean(r["comm_bytes"] for r in late) if late and "comm_bytes" in late[0] else 0,
            "traffic_bytes_per_step": statistics.fmean(traffic_bytes(r, summary["parallel"], trainer.world_size) for r in late) if late else 0,
            "compression_ratio": statistics.fmean(r["compression_ratio"] for r in late) if late and "compression_ratio" in late[0] else None,
            "final_loss": summary["loss"] if summary["loss"] is not None else loss_value,
            "loss_curve": [[r["step"], r.get("loss")] for r in rows],
            "chosen": chosen,
            "parallel": summary["parallel"],
            "state_mb_per_worker": float(memory[0]) / 2**20,
            "peak_rss_mb_per_worker": float(memory[1]) / 2**20,
        }
        Path(args.result).write_text(json.dumps(result))
    trainer.close()
    end_process(0)


# -- the benchmark (runs in the user's process) ---------------------------------------------------

Runner = Callable[[int, list[str]], int]  # (workers, [module, *its arguments]) -> exit code


def local_runner(workers: int, module_argv: list[str]) -> int:
    """A fresh single-node job through torchrun's agent, like `torchrun --standalone -m MODULE ARGS`."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(workers),
               "-m", *module_argv]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.run(command, env=env).returncode


def run_benchmark(
    workload: str,
    configs: list[str],
    *,
    workers: int,
    steps: int,
    batch_size: int,
    runner: Runner,
    single_runner: Runner | None = None,
    warmup: int = 5,
    auto_max_accumulation: int = 1,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the lone reference and every configuration; the report as in `--json`.

    `auto_max_accumulation` > 1 lets auto raise the accumulation up to that many micro-batches.
    """
    single_runner = single_runner or runner
    # Every job trains the same number of steps, so final losses compare; when auto is among
    # the configurations, every job also leaves auto's trial steps out of its throughput.
    job_warmup = warmup + (AUTO_TRIAL_STEPS if "auto" in configs else 0)
    job_steps = steps + job_warmup - warmup
    with tempfile.TemporaryDirectory(prefix="gradsync-bench-") as scratch:

        def job(config: str, count: int, run: Runner) -> dict[str, Any]:
            result = Path(scratch) / f"{config}-{count}.json"
            args = ["--workload", workload, "--config", config, "--steps", str(job_steps), "--warmup", str(job_warmup),
                    "--batch-size", str(batch_size), "--max-accumulation", str(auto_max_accumulation), "--result", str(result),
                    "--run-dir", str(Path(scratch) / f"run-{config}-{count}")]
            code = run(count, ["gradsync.bench.train", *args])
            if code != 0 or not result.exists():
                raise RuntimeError(f"the {config} job on {count} worker(s) failed (exit code {code}); its output is above")
            return json.loads(result.read_text())

        log(f"{workload}: 1 worker, fp32 (the reference, before)")
        single = job("fp32", 1, single_runner)
        results = []
        for config in configs:
            log(f"{workload}: {workers} workers, {config}")
            outcome = job(config, workers, runner)
            results.append(outcome)
            log(f"  {outcome['samples_per_s_per_worker']:.1f} samples/s per worker, exposed comm "
                f"{(outcome['exposed_comm_share'] or 0):.0%}")
        log(f"{workload}: 1 worker, fp32 (the reference, after)")
        single_runs = [single["samples_per_s_per_worker"], job("fp32", 1, single_runner)["samples_per_s_per_worker"]]
        reference = statistics.fmean(single_runs)
        log(f"one worker alone: {reference:.1f} samples/s (before {single_runs[0]:.1f}, after {single_runs[1]:.1f})")
        for outcome in results:
            outcome["scaling_efficiency"] = outcome["samples_per_s_per_worker"] / reference
            log(f"  {outcome['config']}: scaling efficiency {outcome['scaling_efficiency']:.0%}")
        # The network's own capacity, on the same workers: what the configurations compete for.
        log(f"all-reduce sweep on {workers} workers (1K to {SWEEP_MAX})")
        sweep = Path(scratch) / "allreduce.json"
        code = runner(workers, ["gradsync.bench.allreduce", "--max-bytes", SWEEP_MAX, "--factor", "4", "--iters", "10",
                                "--quiet", "--output", str(sweep)])
        if code != 0 or not sweep.exists():
            raise RuntimeError(f"the all-reduce sweep failed (exit code {code}); its output is above")
        allreduce = json.loads(sweep.read_text())["results"]
    return {
        "workload": workload,
        "world_size": workers,
        "batch_size_per_worker": batch_size,
        "steps": job_steps,
        "timed_from_step": job_warmup,
        "auto_max_accumulation": auto_max_accumulation,
        "single_worker_samples_per_s": reference,
        "single_worker_runs": single_runs,  # samples/s before and after the configurations
        "single_worker_final_loss": single["final_loss"],
        "results": results,
        "allreduce": allreduce,
    }


def render(report: dict[str, Any]) -> str:
    runs = report.get("single_worker_runs")  # absent in reports written before it was measured twice
    lines = [
        f"# {report['workload']}: {report['world_size']} workers, batch {report['batch_size_per_worker']} per worker; "
        f"one worker alone: {report['single_worker_samples_per_s']:.1f} samples/s"
        + (f" (before {runs[0]:.1f}, after {runs[1]:.1f})" if runs else ""),
        f"{'config':>9} {'samples/s/worker':>17} {'scaling eff.':>13} {'exposed comm':>13} {'sent MB/step':>13} "
        f"{'state MB':>9} {'peak RSS MB':>12} {'final loss':>11}  chosen",
    ]
    for r in report["results"]:
        picked = r.get("chosen") or {}
        chosen = picked.get("compression") or ""
        if picked.get("accumulation_steps", 1) > 1:
            chosen += f", accumulation {picked['accumulation_steps']}"
        lines.append(
            f"{r['config']:>9} {r['samples_per_s_per_worker']:>17.1f} {r['scaling_efficiency']:>12.0%} "
            f"{(r['exposed_comm_share'] or 0):>12.0%} {r.get('traffic_bytes_per_step', r['comm_bytes_per_step']) / 2**20:>13.2f} "
            f"{r.get('state_mb_per_worker', float('nan')):>9.1f} {r.get('peak_rss_mb_per_worker', float('nan')):>12.0f} "
            f"{r['final_loss']:>11.4f}  {chosen}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    worker_main()
