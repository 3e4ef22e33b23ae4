"""What `gradsync run` costs over plain torchrun on a healthy DDP job, measured side by side.

Three measurements (2 processes, Gloo):

1. whole launches: the same training script is launched by `torchrun`, by `gradsync run` and by
   `gradsync run --flight-recorder 0`, in rotating order for several rounds so that drift hits
   all alike. This includes everything (recorder, Flight Recorder, snapshot thread, the
   launcher's monitor) but between-launch noise on a small machine is several percent.
2. in one job: the same processes alternate short blocks of steps with the recorder off, on
   (ring file and snapshot thread included) and on under `--record-buckets`. Each back-to-back
   round gives one ratio per recorded block; the median of many rounds, with a confidence
   interval, pins down the recorder's own cost far better than whole launches (see
   `in_process_worker` for how model-to-model differences are cancelled).
3. Flight Recorder per collective: it is on or off for a whole process (torch reads its buffer
   size once), so one process per arm, alternating: the time of a small all_reduce on a
   one-rank Gloo group with and without it, and what that adds to a 20 ms step that makes
   STEP_COLLECTIVES collectives.

Run with `make bench-run-overhead` or `python benchmarks/run_overhead.py [--rounds 4]`.
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

from gradsync.distributed import end_process


def build_model(width: int):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(256, width), torch.nn.BatchNorm1d(width), torch.nn.ReLU(),
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 10),
    )


def timed_steps(model, optimizer, x, y, steps: int) -> list[float]:
    import torch

    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return times


def slowest_rank_median(times: list[float]) -> float:
    import torch
    import torch.distributed as dist

    median = torch.tensor([statistics.median(times)])
    dist.all_reduce(median, op=dist.ReduceOp.MAX)  # the job runs at its slowest rank's pace
    return median.item()


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    model = DistributedDataParallel(build_model(args.width))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(args.batch_size, 256, generator=generator), torch.randint(0, 10, (args.batch_size,), generator=generator)
    timed_steps(model, optimizer, x, y, args.warmup)
    median = slowest_rank_median(timed_steps(model, optimizer, x, y, args.steps))
    if dist.get_rank() == 0:
        Path(args.result).write_text(json.dumps({"median_step_s": median}))
    dist.barrier()
    end_process(0)  # not destroy_process_group() with DDP models alive: see gradsync.distributed


def in_process_worker(args: argparse.Namespace) -> None:
    """Blocks of steps on three models in one job: plain, recorded, and recorded per bucket.

    Two identical DDP models differ by a few percent in speed here even with nothing recorded
    (measured 3%: memory placement), as much as the recorder costs. So the default recorder is
    measured on two models that swap roles every round, one recorded while the other runs plain
    DDP (between rounds the recorder is uninstalled, and a model on DDP's C++ path is then plain).
    `--record-buckets` registers a comm hook for good, so its model is compared with whichever
    runs plain: that ratio carries the instance difference, within its wider interval.
    """
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from gradsync.run.collectives import CollectiveRecorder, install
    from gradsync.run.options import RunOptions
    from gradsync.rundir import RingWriter, RunDir
    from gradsync.run.worker import SnapshotWriter

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    options = RunOptions(run_dir=Path(args.result).parent / "in_process")
    recorder = CollectiveRecorder(options.ring_size)
    recorder.sink = RingWriter(RunDir(options.run_dir).ring(0, rank), options.ring_size)
    identity = {"rank": rank, "attempt": 0, "pid": 0}
    x_generator = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch_size, 256, generator=x_generator)
    y = torch.randint(0, 10, (args.batch_size,), generator=x_generator)
    models = {}
    for name, record_buckets in (("a", False), ("b", False), ("buckets", True)):
        uninstall = install(recorder, record_buckets=record_buckets)
        models[name] = DistributedDataParallel(build_model(args.width))
        optimizer = torch.optim.SGD(models[name].parameters(), lr=0.01)
        models[name] = (models[name], optimizer)
        timed_steps(*models[name], x, y, 2)  # the first forward fixes how the model reduces
        uninstall()

    def block(name: str, recorded: bool) -> float:
        if not recorded:
            return statistics.median(timed_steps(*models[name], x, y, args.steps_per_block))
        uninstall = install(recorder, record_buckets=name == "buckets")
        writer = SnapshotWriter(recorder, options, identity, flight_on=False)
        writer.start()
        median = statistics.median(timed_steps(*models[name], x, y, args.steps_per_block))
        writer.stopped.set()
        uninstall()
        return median

    for name in models:
        block(name, recorded=False), block(name, recorded=True)  # warm-up
    ratios: dict[str, list[float]] = {"recorded": [], "record_buckets": []}
    plain_medians = []
    for round_ in range(args.rounds_in_job):
        plain, recorded = ("a", "b") if round_ % 2 == 0 else ("b", "a")
        blocks = [("plain", plain, False), ("recorded", recorded, True), ("record_buckets", "buckets", True)]
        shift = (round_ // 2) % len(blocks)  # rotate who goes first
        medians = {arm: block(name, on) for arm, name, on in blocks[shift:] + blocks[:shift]}
        # The job runs at its slowest rank's pace. Each arm's slowest median, then the ratio: the
        # larger of two ranks' noisy ratios would be biased upwards (3% here, nothing recorded).
        slowest = torch.tensor([medians["plain"]] + [medians[arm] for arm in ratios])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        plain_medians.append(slowest[0].item())
        # A round's blocks run back to back, so slow drift of the machine cancels in their ratios.
        for arm, median in zip(ratios, slowest[1:].tolist()):
            ratios[arm].append(median / slowest[0].item())
    if rank == 0:
        Path(args.result).write_text(json.dumps({"ratios": ratios, "plain_step_s": statistics.median(plain_medians)}))
    dist.barrier()
    end_process(0)  # not destroy_process_group() with DDP models alive: see gradsync.distributed


STEP_COLLECTIVES = 8  # a DDP step's bucket all-reduces plus a few of the script's own (metrics, checks)


def flight_recorder_worker(args: argparse.Namespace) -> None:
    """Median seconds per small all_reduce on a one-rank group (Flight Recorder on or off by the
    environment this process was started with)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    tensor = torch.ones(1)
    medians = []
    for _ in range(args.fr_blocks):
        start = time.perf_counter()
        for _ in range(args.fr_calls):
            dist.all_reduce(tensor)
        medians.append((time.perf_counter() - start) / args.fr_calls)
    Path(args.result).write_text(json.dumps({"per_call_s": statistics.median(medians)}))
    dist.destroy_process_group()


def flight_recorder_cost(args: argparse.Namespace, scratch: Path) -> tuple[float, float]:
    """(seconds per collective off, seconds added per collective by Flight Recorder), medians over
    alternating processes."""
    per_call: dict[str, list[float]] = {"off": [], "on": []}
    for round_ in range(args.fr_rounds):
        for arm in (("off", "on") if round_ % 2 == 0 else ("on", "off")):
            result = scratch / f"fr_{arm}.json"
            env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_FR_BUFFER_SIZE": "2000" if arm == "on" else "0"}
            subprocess.run([sys.executable, __file__, "--flight-recorder-worker", "--result", str(result), "--fr-calls",
                            str(args.fr_calls), "--fr-blocks", str(args.fr_blocks)], check=True, env=env)
            per_call[arm].append(json.loads(result.read_text())["per_call_s"])
    off = statistics.median(per_call["off"])
    return off, statistics.median(per_call["on"]) - off


def median_with_interval(values: list[float]) -> tuple[float, float, float]:
    """The median and a distribution-free ~95% confidence interval for it (binomial order statistics)."""
    ordered = sorted(values)
    n = len(ordered)
    half_width = 0.98 * n**0.5  # 1.96 * sqrt(n) / 2 ranks either side of the middle
    low = max(0, int(n / 2 - half_width))
    high = min(n - 1, int(n / 2 + half_width))
    return statistics.median(ordered), ordered[low], ordered[high]


def launch(launcher: list[str], args: argparse.Namespace, result: Path) -> float:
    """One whole job under `launcher`; its slowest rank's median step time."""
    command = [
        *launcher, "--standalone", "--nproc-per-node", "2", __file__, "--worker", "--result", str(result),
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--width", str(args.width),
        "--batch-size", str(args.batch_size),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads(result.read_text())["median_step_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="ABBA rounds of whole launches (0 skips them)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--rounds-in-job", type=int, default=200, help="rounds of blocks (recorder off, on, on with buckets) in the one-job measurement")
    parser.add_argument("--steps-per-block", type=int, default=20)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--fr-rounds", type=int, default=6, help="alternating process pairs for the Flight Recorder cost")
    parser.add_argument("--fr-calls", type=int, default=2000)
    parser.add_argument("--fr-blocks", type=int, default=5)
    parser.add_argument("--flight-recorder-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--in-process-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.in_process_worker:
        in_process_worker(args)
        return
    if args.flight_recorder_worker:
        flight_recorder_worker(args)
        return
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as scratch:
        gradsync_run = [sys.executable, "-m", "gradsync", "run", "--run-dir", str(Path(scratch) / "run")]
        launchers = {"torchrun": torchrun, "gradsync run": gradsync_run, "gradsync run, Flight Recorder off": [*gradsync_run, "--flight-recorder", "0"]}
        times: dict[str, list[float]] = {name: [] for name in launchers}
        names = list(launchers)
        for round_ in range(args.rounds):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                times[name].append(launch(launchers[name], args, Path(scratch) / "launch.json"))
            print(f"launch round {round_ + 1}: " + ", ".join(f"{name} {times[name][-1] * 1e3:.2f} ms/step" for name in names), flush=True)
        if args.rounds:
            plain = statistics.median(times["torchrun"])
            print(f"whole launches (median of {args.rounds} launches each, {args.steps} steps), step time / torchrun's:")
            for name in names[1:]:
                print(f"  {name}: {statistics.median(times[name]) / plain:.3f}")
        off, added = flight_recorder_cost(args, Path(scratch))
        result = Path(scratch) / "in_process.json"
        subprocess.run(
            [*torchrun, "--standalone", "--nproc-per-node", "2", __file__, "--in-process-worker", "--result", str(result),
             "--rounds-in-job", str(args.rounds_in_job), "--steps-per-block", str(args.steps_per_block), "--width", str(args.width),
             "--batch-size", str(args.batch_size)],
            check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        in_job = json.loads(result.read_text())
    print(f"in one job ({args.rounds_in_job} rounds of {args.steps_per_block}-step blocks; plain step "
          f"{in_job['plain_step_s'] * 1e3:.2f} ms):")
    for name, ratios in in_job["ratios"].items():
        median, low, high = median_with_interval(ratios)
        label = "recorder (default) / off" if name == "recorded" else "recorder --record-buckets / off"
        print(f"  {label} = {median:.3f} (95% interval {low:.3f}-{high:.3f})")
    print(f"Flight Recorder: {added * 1e6:+.1f} us per collective ({off * 1e6:.1f} us without it, median of "
          f"{args.fr_rounds} processes each); at {STEP_COLLECTIVES} collectives per 20 ms step: "
          f"{STEP_COLLECTIVES * added / 0.020 * 100:+.2f}% of the step")


if __name__ == "__main__":
    main()
