"""`gradsync bench train`: what each communication setting buys on a real training workload,
next to the peers a user would otherwise write.

For a built-in workload it runs one worker alone (the reference), then N workers per
configuration, each a fresh job through the launcher, in interleaved rounds (`rounds`, default
2: every configuration once per round, the order reversed every other round and rotated every
two, so that no configuration keeps its place) with the lone
worker again after each round. Round r's efficiency is against the lone runs just before and
after it, and each configuration reports the median over its rounds and their spread: on a
machine whose whole-run figures swing by 10 points, only comparisons inside one run mean
anything, and the interleaving keeps drift from favouring whoever ran early or late. It reports per configuration: samples/s
per worker, scaling efficiency (per-worker throughput / the lone worker's), the share of step
time spent in exposed communication, bytes sent per step, and the final loss. The global batch
is the same for every configuration (per-worker batch x N), so losses are comparable, unless
auto is allowed to raise accumulation (`--auto-max-accumulation`): then its report says what it
chose. Steps here are micro-batches (batches each worker takes), whatever the accumulation.

Configurations: fp32 or ddp (DDP's plain all-reduce), fp16, bf16, powersgd, int8, topk (gradient
compression, gradsync.comm), auto (tries them and keeps the fastest), the other parallelism
strategies (gradsync.parallel): fsdp, hsdp (sharded within a host, replicated across), tp (tensor
parallel over every worker) and fsdp+tp (tensor parallel within a host, FSDP across), periodic
synchronisation (gradsync.comm.periodic: diloco and local-sgd, agreeing every `periodic_every`
optimizer steps; their final loss says what it costs), and the
peers (gradsync.bench.peers): plain (a hand-written DDP loop without gradsync), torch-fp16,
torch-bf16 and torch-powersgd (PyTorch's own hooks on that loop), no-comm (that loop without
DDP: the ceiling, workers that compete for the machine but never communicate) and lockstep
(no-comm whose workers wait for each other once a step: the ceiling of synchronous training,
where every step lasts as long as its slowest worker's, up to a run's noise). Every one
keeps the same global batch: a tensor-parallel group takes the batches of all its workers at
once. Throughput is measured after `warmup` steps; auto's warm-up includes its trials, so its
number is what it settled on. Memory per worker is reported two ways: the model state it holds
(parameters, gradients and optimizer state, its shards only under FSDP and TP) and the process's
peak resident memory (activations, buffers and the runtime included), with its minor page
faults per timed step: on CPU a fault costs ~2 us, and tens of thousands a step are a cost the
configuration's communication does not explain (gradsync.host_memory).

Every job runs with the same allocator setting, `--host-memory` (default auto: on CPU, freed host
memory is kept for the next step): gradsync's jobs set it up themselves, and every job, the
peers included, is started with the environment that gives an unmodified script the same
(gradsync.host_memory.allocator_environment: GLIBC_TUNABLES). `--host-memory release` runs
everything with the C library's defaults. A ratio between a gradsync job and a peer then credits
the communication alone, not an allocator only one side had.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

from gradsync.bench.peers import PEERS, faults_per_step, job_parser, minor_page_faults
from gradsync.comm.auto import DECISION_STEPS
from gradsync.errors import ConfigError
from gradsync.host_memory import allocator_environment
from gradsync.rundir import RunDir

COMPRESSIONS = ("fp32", "fp16", "bf16", "powersgd", "int8", "topk", "auto")
STRATEGIES = ("ddp", "fsdp", "hsdp", "tp", "fsdp+tp", "pp", "pp+ddp")
PERIODIC = {"diloco": "diloco", "local-sgd": "average"}  # config -> ddp.periodic.method (every --periodic-every steps)
CONFIGS = COMPRESSIONS + STRATEGIES + tuple(PERIODIC) + PEERS
SWEEP_MAX = "64M"  # largest all-reduce in the report's bandwidth sweep
AUTO_TRIAL_STEPS = DECISION_STEPS  # steps before auto has settled, left out of every job's throughput


def compression_for(config: str) -> str:
    return "none" if config in ("fp32", *STRATEGIES, *PERIODIC) else config


def parallel_for(config: str, world: int, local_world: int, split_points: dict[int, tuple[str, ...]] | None = None) -> dict[str, Any]:
    """The strategy of a configuration; the 2-D ones split at the host (a host's workers share
    the fast links), or in halves when every worker is on one host. A pipeline spans the hosts
    (its activations cross the slow link, "pp+ddp"'s all-reduce stays on a host's), cut at the
    workload's `split_points` for that many stages."""
    if config not in STRATEGIES:
        return {"strategy": "ddp"}
    inner = local_world if 1 < local_world < world else max(world // 2, 1)
    if config in ("pp", "pp+ddp"):
        stages = world if config == "pp" else world // inner
        if stages not in (split_points or {}):
            raise ConfigError(f"--configs {config}: this workload has no pipeline cut into {stages} stages "
                              f"(it has {sorted(split_points or {}) or 'none'}).")
        return {"strategy": config, "split_points": split_points[stages],  # type: ignore[index]
                **({"pp_size": stages} if config == "pp+ddp" else {})}
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
    if parallel["strategy"] in ("pp", "pp+ddp"):
        # Point-to-point bytes go once; a stage's all-reduce runs among its dp_size copies.
        return row.get("p2p_bytes", 0) + row.get("all_reduce_bytes", 0) * 2 * share(parallel.get("dp_size", 1))
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
    repeated = sorted({c for c in configs if configs.count(c) > 1})
    if repeated:
        raise ConfigError(f"--configs {text!r} names {', '.join(repeated)} twice; each runs in every round (--rounds).")
    return configs


# -- one job (runs in every worker) ---------------------------------------------------------------


def worker_main(argv: list[str] | None = None) -> None:
    import torch
    import torch.distributed as dist

    from gradsync.trainer import setup
    from gradsync.bench.workloads import WORKLOADS
    from gradsync.distributed import end_process

    parser = job_parser("gradsync.bench.train", CONFIGS)
    parser.add_argument("--max-accumulation", type=int, default=1)
    parser.add_argument("--periodic-every", type=int, default=16)
    parser.add_argument("--run-dir", required=True)
    args = parser.parse_args(argv)

    workload = WORKLOADS[args.workload]
    auto = args.config == "auto"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    parallel = parallel_for(args.config, world, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), workload.split_points)
    trainer = setup(
        host_memory=args.host_memory,
        ddp={
            "compression": {"name": "auto", "max_accumulation_steps": args.max_accumulation} if auto else compression_for(args.config),
            "bucket_cap_mb": "auto" if auto else 25.0,
            **({"periodic": {"every": args.periodic_every, "method": PERIODIC[args.config]}} if args.config in PERIODIC else {}),
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
    # A tensor-parallel group or a pipeline computes one copy of the model: it takes its workers' batches together.
    together = {"tp": world, "pp": world}.get(parallel["strategy"]) or parallel.get("tp_size") or parallel.get("pp_size") or 1
    group_batch = args.batch_size * together
    model, optimizer, loader = trainer.prepare(model, optimizer, dataset, batch_size=group_batch, shuffle=False)
    step_ends: list[float] = []
    faults: list[int] = []
    loss_value = float("nan")
    for _ in trainer.epochs(1):
        for batch in loader:
            inputs, targets = batch
            with trainer.step() as step:
                loss = step.forward_backward(inputs, targets, workload.loss_fn)  # a pipeline's way, every strategy's too
            trainer.log(loss=loss)
            step_ends.append(time.perf_counter())
            faults.append(minor_page_faults())
            loss_value = loss.item()
    summary = trainer.summary()
    # The worst worker's: state, peak memory and page faults per timed step.
    memory = torch.tensor([model_state_bytes(model, optimizer), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                           faults_per_step(faults[args.warmup:])], dtype=torch.float64, device=trainer.device)
    if trainer.world_size > 1:
        dist.all_reduce(memory, op=dist.ReduceOp.MAX)
    memory = memory.cpu()
    rows = [json.loads(line) for line in RunDir(trainer.run_dir).metrics.read_text().splitlines()] if trainer.is_main else []
    chosen = summary.get("auto")
    measured = step_ends[args.warmup :]
    seconds = torch.tensor([measured[-1] - measured[0] if len(measured) > 1 else float("nan")], dtype=torch.float64,
                           device=trainer.device)
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
            # A step that sent nothing (periodic synchronisation between agreements) has no byte counts.
            "comm_bytes_per_step": statistics.fmean(r.get("comm_bytes", 0) for r in late) if late else 0,
            "traffic_bytes_per_step": statistics.fmean(traffic_bytes(r, summary["parallel"], trainer.world_size) for r in late) if late else 0,
            "compression_ratio": statistics.fmean(ratios) if (ratios := [r["compression_ratio"] for r in late if "compression_ratio" in r]) else None,
            # A pipeline's idle share of the step (gradsync.parallel.pp), measured on every rank.
            "bubble_share": statistics.fmean(bubbles) if (bubbles := [r["pipeline_bubble_share"] for r in late if "pipeline_bubble_share" in r]) else None,
            "final_loss": summary["loss"] if summary["loss"] is not None else loss_value,
            "loss_curve": [[r["step"], r.get("loss")] for r in rows],
            "chosen": chosen,
            "periodic_every": args.periodic_every if args.config in PERIODIC else None,
            "parallel": summary["parallel"],
            "state_mb_per_worker": float(memory[0]) / 2**20,
            "peak_rss_mb_per_worker": float(memory[1]) / 2**20,
            "page_faults_per_step": float(memory[2]),
        }
        Path(args.result).write_text(json.dumps(result))
    trainer.close()
    end_process(0)


# -- the benchmark (runs in the user's process) ---------------------------------------------------

# (workers, [module, *its arguments], variables added to the workers' environment) -> exit code
Runner = Callable[[int, list[str], Mapping[str, str]], int]


def local_runner(workers: int, module_argv: list[str], environment: Mapping[str, str]) -> int:
    """A fresh single-node job through torchrun's agent, like `torchrun --standalone -m MODULE ARGS`."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(workers),
               "-m", *module_argv]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **environment}
    return subprocess.run(command, env=env).returncode


def _median_round(outcomes: list[dict[str, Any]], references: list[float]) -> dict[str, Any]:
    """One configuration's rounds as one result: the median round's keys (its loss, its bytes),
    the median throughput and efficiency, and every round with the spread.

    Round r's efficiency is against the lone worker's runs just before and after it, so a
    machine that drifts during the benchmark moves both sides of the ratio alike."""
    rounds = [
        {"samples_per_s_per_worker": o["samples_per_s_per_worker"],
         "scaling_efficiency": o["samples_per_s_per_worker"] / statistics.fmean(references[r:r + 2]),
         # auto's choice in each round: the same in every round is what it promises (issue 43).
         **({"chosen": o["chosen"]["compression"]} if (o.get("chosen") or {}).get("compression") else {})}
        for r, o in enumerate(outcomes)
    ]
    efficiencies = [r["scaling_efficiency"] for r in rounds]
    middle = sorted(range(len(rounds)), key=efficiencies.__getitem__)[(len(rounds) - 1) // 2]
    return {
        **outcomes[middle],
        "samples_per_s_per_worker": statistics.median(r["samples_per_s_per_worker"] for r in rounds),
        "scaling_efficiency": statistics.median(efficiencies),
        "scaling_efficiency_spread": [min(efficiencies), max(efficiencies)],
        "rounds": rounds,
    }


def round_order(configs: list[str], round_number: int) -> list[str]:
    """The order of round `round_number`: the configurations rotated by one place every two
    rounds, each second round the reverse of the first.

    Reversal alone keeps each configuration in the same two places for ever (of A B C D, B is
    always second or third). On this machine the second job of a round once ran 5-8% faster
    than the later ones in all three rounds of a run (whichever configuration it was), so a
    configuration's place must move: over 2k rounds with k = len(configs) each one runs in
    every place, twice.
    """
    shift = (round_number // 2) % len(configs)
    order = configs[shift:] + configs[:shift]
    return order if round_number % 2 == 0 else order[::-1]


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
    rounds: int = 2,
    auto_max_accumulation: int = 1,
    periodic_every: int = 16,
    host_memory: str = "auto",
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the lone reference and every configuration, in interleaved rounds; the report as in `--json`.

    Each round runs every configuration once, in `round_order` (reversed every other round,
    rotated every two), with the lone worker before the first round and after each: a
    configuration measured early is not favoured by a machine that slows down later, nor one
    measured next to the reference or in a favoured place of the round.
    `auto_max_accumulation` > 1 lets auto raise the accumulation up to that many micro-batches.
    `periodic_every`: the optimizer steps between agreements of `diloco` and `local-sgd`.
    `host_memory`: the allocator setting of every job (gradsync.host_memory): gradsync's jobs
    apply it, and every job is started with the environment that applies it to a plain script.
    """
    single_runner = single_runner or runner
    # Every job trains the same number of steps, so final losses compare; when auto is among
    # the configurations, every job also leaves auto's trial steps out of its throughput.
    job_warmup = warmup + (AUTO_TRIAL_STEPS if "auto" in configs else 0)
    job_steps = steps + job_warmup - warmup
    import torch

    allocator = allocator_environment(host_memory, "cuda" if torch.cuda.is_available() else "cpu", os.environ)
    with tempfile.TemporaryDirectory(prefix="gradsync-bench-") as scratch:

        def job(config: str, count: int, run: Runner, attempt: int) -> dict[str, Any]:
            result = Path(scratch) / f"{config}-{count}-{attempt}.json"
            args = ["--workload", workload, "--config", config, "--steps", str(job_steps), "--warmup", str(job_warmup),
                    "--batch-size", str(batch_size), "--max-accumulation", str(auto_max_accumulation), "--periodic-every", str(periodic_every), "--host-memory", host_memory, "--result", str(result),
                    "--run-dir", str(Path(scratch) / f"run-{config}-{count}-{attempt}")]
            module = "gradsync.bench.peers" if config in PEERS else "gradsync.bench.train"
            code = run(count, [module, *args], allocator)
            if code != 0 or not result.exists():
                raise RuntimeError(f"the {config} job on {count} worker(s) failed (exit code {code}); its output is above")
            return json.loads(result.read_text())

        def reference(attempt: int) -> dict[str, Any]:
            log(f"{workload}: 1 worker, fp32 (the reference, {'before round 1' if attempt == 0 else f'after round {attempt}'})")
            return job("fp32", 1, single_runner, attempt)

        single = reference(0)
        references = [single["samples_per_s_per_worker"]]
        outcomes: dict[str, list[dict[str, Any]]] = {config: [] for config in configs}
        for round_number in range(rounds):
            for config in round_order(configs, round_number):
                log(f"{workload}: {workers} workers, {config} (round {round_number + 1} of {rounds})")
                outcome = job(config, workers, runner, round_number)
                outcomes[config].append(outcome)
                exposed = outcome["exposed_comm_share"]
                log(f"  {outcome['samples_per_s_per_worker']:.1f} samples/s per worker"
                    + (f", exposed comm {exposed:.0%}" if exposed is not None else ""))
            references.append(reference(round_number + 1)["samples_per_s_per_worker"])
        log(f"one worker alone: {statistics.fmean(references):.1f} samples/s "
            f"({', '.join(f'{r:.1f}' for r in references)} around the rounds)")
        results = [_median_round(outcomes[config], references) for config in configs]
        for outcome in results:
            low, high = outcome["scaling_efficiency_spread"]
            log(f"  {outcome['config']}: scaling efficiency {outcome['scaling_efficiency']:.0%} (rounds {low:.0%}-{high:.0%})")
        # The network's own capacity, on the same workers: what the configurations compete for.
        log(f"all-reduce sweep on {workers} workers (1K to {SWEEP_MAX})")
        sweep = Path(scratch) / "allreduce.json"
        code = runner(workers, ["gradsync.bench.allreduce", "--max-bytes", SWEEP_MAX, "--factor", "4", "--iters", "10",
                                "--quiet", "--output", str(sweep)], allocator)
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
        "periodic_every": periodic_every,
        "host_memory": host_memory,
        "peers_host_memory": True,  # the peers ran with it too (reports from before ran them with the defaults)
        "rounds": rounds,
        "single_worker_samples_per_s": statistics.fmean(references),
        "single_worker_runs": references,  # samples/s before the first round and after each
        "single_worker_final_loss": single["final_loss"],
        "results": results,
        "allreduce": allreduce,
    }


def _megabytes(value: float | None) -> str:
    return "—" if value is None else f"{value / 2**20:.2f}"


def render(report: dict[str, Any]) -> str:
    runs = report.get("single_worker_runs")  # absent in reports written before it was measured twice
    rounds = report.get("rounds", 1)
    lines = [
        f"# {report['workload']}: {report['world_size']} workers, batch {report['batch_size_per_worker']} per worker, "
        f"{rounds} round{'s' if rounds > 1 else ''}; one worker alone: {report['single_worker_samples_per_s']:.1f} samples/s"
        + (f" ({', '.join(f'{r:.1f}' for r in runs)} around the rounds)" if runs else ""),
        f"{'config':>14} {'samples/s/worker':>17} {'scaling eff.':>13} {'rounds':>9} {'exposed comm':>13} {'sent MB/step':>13} "
        f"{'state MB':>9} {'peak RSS MB':>12} {'faults/step':>12} {'final loss':>11}  chosen",
    ]
    for r in report["results"]:
        picked = r.get("chosen") or {}
        chosen = picked.get("compression") or ""
        if picked.get("accumulation_steps", 1) > 1:
            chosen += f", accumulation {picked['accumulation_steps']}"
        if r.get("periodic_every"):
            chosen = f"agrees every {r['periodic_every']} steps"
        spread = r.get("scaling_efficiency_spread")
        spread_text = f"{spread[0]:.0%}-{spread[1]:.0%}" if spread and len(r.get("rounds", [])) > 1 else "—"
        exposed = r["exposed_comm_share"]
        lines.append(
            f"{r['config']:>14} {r['samples_per_s_per_worker']:>17.1f} {r['scaling_efficiency']:>12.0%} {spread_text:>9} "
            f"{'—' if exposed is None else f'{exposed:.0%}':>13} {_megabytes(r.get('traffic_bytes_per_step', r['comm_bytes_per_step'])):>13} "
            f"{r.get('state_mb_per_worker', float('nan')):>9.1f} {r.get('peak_rss_mb_per_worker', float('nan')):>12.0f} "
            f"{r.get('page_faults_per_step', float('nan')):>12.0f} {r['final_loss']:>11.4f}  {chosen}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    worker_main()
