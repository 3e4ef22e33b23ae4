"""The peers `gradsync bench train` measures gradsync against: a hand-written DDP loop, and
PyTorch's own communication hooks on that loop.

A peer trains the same workload (model, data, optimizer, batch per worker, bucket size) as
gradsync's configurations, written the way a user writes it without gradsync: a
DistributedSampler, DDP and one of torch's hooks. It reports the keys of gradsync's own jobs
that a bare loop can know (throughput, the final loss); what only gradsync meters (exposed
communication, bytes sent) is None, except lockstep's exposed share: how much of a step its
workers waited for each other.

Configurations: `plain` (DDP's own all-reduce), `torch-fp16` and `torch-bf16`
(`fp16_compress_hook`, `bf16_compress_hook`), `torch-powersgd` (`powerSGD_hook`, rank 4, error
feedback and warm start, plain all-reduce for the first ~10% of the steps, as gradsync's
`powersgd` does), and `no-comm`: the same loop without DDP, so the workers never communicate.
`no-comm` is the ceiling of scaling efficiency on the machine at hand: its workers still compete
for cores and memory bandwidth, which no communication setting can win back. On the 2-core
machine behind docs/performance.md, two ResNet-18 workers side by side lost between nothing and
a tenth to each other, and the figure moved by as much between runs.

`lockstep` is `no-comm` whose workers wait for each other once a step, as synchronous training
makes them, and send nothing else (a one-number all-reduce after backward): synchronous
training with the communication free and only the waiting left, the ceiling of DDP up to a
run's noise. `no-comm` flatters: a worker whose step was slowed holds nobody up, while under DDP
every step lasts as long as its slowest worker's.

Every peer runs with the allocator setting of gradsync's jobs,
given to it through its environment (`--host-memory`, gradsync.host_memory.allocator_environment),
so the script itself stays as a user writes it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

from gradsync.host_memory import HOST_MEMORY

PEERS = ("plain", "torch-fp16", "torch-bf16", "torch-powersgd", "no-comm", "lockstep")
UNSYNCHRONISED = ("no-comm", "lockstep")  # the ceilings: the loop without DDP
LOSS_EVERY = 5  # steps between the loss curve's points (the trainer logs every 5 in the benchmark too)
BUCKET_CAP_MB = 25.0  # DDP's default, and gradsync's fixed configurations'


def waited_share_of_span(step_ends: list[float], waits: list[float], warmup: int) -> float:
    """The share of the timed span a worker spent waiting: numerator and denominator over the same steps.

    The span runs from the end of step `warmup + 1` to the end of the last step, so it holds the
    steps after that one; only their waits count. Each wait lies inside its own step, so the share
    stays in [0, 1] however few the steps or however loaded the machine (counting the wait of the
    step the span starts at put a read of 1.04 in a table of shares).
    """
    if len(step_ends) - warmup < 2:
        return float("nan")
    span = step_ends[-1] - step_ends[warmup]
    return sum(waits[warmup + 1:]) / span if span > 0 else 0.0


def job_parser(module: str, configs: tuple[str, ...]) -> argparse.ArgumentParser:
    """The command line of one benchmark job, gradsync's or a peer's: the same workload, steps and batch."""
    from gradsync.bench.workloads import WORKLOADS

    parser = argparse.ArgumentParser(prog=f"python -m {module}")
    parser.add_argument("--workload", choices=tuple(WORKLOADS), required=True)
    parser.add_argument("--config", choices=configs, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--result", required=True)
    parser.add_argument("--host-memory", choices=HOST_MEMORY, default="auto",
                        help="gradsync's jobs' host_memory; a peer gets it from its environment, and ignores this")
    return parser


def minor_page_faults() -> int:
    """This process's minor page faults so far: pages the OS had to map in on first touch."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def faults_per_step(counts: list[int]) -> float:
    """Minor page faults per step from the running counts at each timed step's end.

    Reported beside throughput because on CPU they are a cost the step times alone cannot
    explain: ~2 us each, and tens of thousands a step when the allocator hands memory back to
    the OS between steps (gradsync.host_memory).
    """
    return (counts[-1] - counts[0]) / (len(counts) - 1) if len(counts) > 1 else float("nan")


def _register_hook(model, config: str, steps: int) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if config == "torch-fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif config == "torch-bf16":
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif config == "torch-powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=max(2, steps // 10),
            use_error_feedback=True, warm_start=True,
        )
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


def main(argv: list[str] | None = None) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    from gradsync.bench.workloads import WORKLOADS
    from gradsync.distributed import end_process

    args, _ = job_parser("gradsync.bench.peers", PEERS).parse_known_args(argv)  # a peer ignores gradsync's own options

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda" if cuda else "cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    workload = WORKLOADS[args.workload]
    torch.manual_seed(0)
    model = workload.build_model().to(device)
    dataset = workload.build_dataset(args.steps * args.batch_size * world)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=DistributedSampler(dataset, shuffle=False))
    if args.config not in UNSYNCHRONISED:
        model = DistributedDataParallel(model, bucket_cap_mb=BUCKET_CAP_MB)
        _register_hook(model, args.config, args.steps)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=args.lr, momentum=0.9)
    step_ends: list[float] = []
    faults: list[int] = []
    curve: list[list[float]] = []
    token = torch.zeros(1, device=device)  # lockstep's one number a step
    waits: list[float] = []  # lockstep: per step, how long this worker waited for the other
    for step, batch in enumerate(loader, 1):
        batch = [t.to(device, non_blocking=True) for t in batch]
        loss = workload.loss(model, batch)
        optimizer.zero_grad()
        loss.backward()
        if args.config == "lockstep":
            if cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            dist.all_reduce(token)
            if cuda:
                torch.cuda.synchronize()
            waits.append(time.perf_counter() - started)
        optimizer.step()
        if step % LOSS_EVERY == 0:
            curve.append([step, loss.item()])  # this rank's: averaging it would add a collective per point
        if cuda:
            torch.cuda.synchronize()
        step_ends.append(time.perf_counter())
        faults.append(minor_page_faults())
    measured = step_ends[args.warmup:]
    elapsed = measured[-1] - measured[0] if len(measured) > 1 else float("nan")
    # lockstep's exposed communication: the share of its timed steps this worker waited for the other.
    waited_share = waited_share_of_span(step_ends, waits, args.warmup) if waits else 0.0
    totals = torch.tensor([elapsed, loss.item() / world, waited_share / world,
                           resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                           faults_per_step(faults[args.warmup:])], dtype=torch.float64, device=device)
    seconds = totals[:1].clone()
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the job runs at its slowest worker's pace
    dist.all_reduce(totals[1:3])  # the last step's loss and lockstep's waited share, averaged over the workers
    peak = totals[3:].clone()  # peak memory and page faults: the worst worker's
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        timed_steps = len(measured) - 1
        state = sum(p.numel() * p.element_size() * (3 if p.requires_grad else 1) for p in model.parameters())
        result = {
            "config": args.config,
            "world_size": world,
            "samples_per_s_per_worker": timed_steps * args.batch_size / float(seconds) if timed_steps > 0 else None,
            "exposed_comm_share": float(totals[2]) if args.config == "lockstep" else None,
            "comm_bytes_per_step": None,
            "traffic_bytes_per_step": None,
            "compression_ratio": None,
            "final_loss": float(totals[1]),
            "loss_curve": curve,
            "chosen": None,
            "parallel": {"strategy": "ddp"},
            "state_mb_per_worker": state / 2**20,  # parameters, gradients and SGD's momentum
            "peak_rss_mb_per_worker": float(peak[0]) / 2**20,
            "page_faults_per_step": float(peak[1]),
        }
        Path(args.result).write_text(json.dumps(result))
    dist.barrier()
    end_process(0)  # not the interpreter's teardown, which races with Gloo's threads (gradsync.distributed)


if __name__ == "__main__":
    main()
