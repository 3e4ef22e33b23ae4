"""What the background system sampler costs a training loop, measured two ways.

1. Its own CPU time per sample (psutil reads of /proc, NVML where present), on the sampler's
   thread: the cost at any rate is this times the rate.
2. Side by side, in one DDP job (2 processes, Gloo): back-to-back blocks of steps with the
   sampler off and on at 10 samples a second (10x the default, so that a cost would show),
   reported as the median block ratio with a 95% interval.

Run with `make bench-system-sampler` or
`python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/system_sampler_overhead.py`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from gradsync.distributed import end_process
from gradsync.metrics.system import SystemSampler, backend_interface
from run_overhead import median_with_interval  # benchmarks/ is on the path of a script run from it


def sample_cost_s(sampler: SystemSampler, samples: int = 300) -> float:
    start = time.thread_time()
    for _ in range(samples):
        sampler.sample()
    return (time.thread_time() - start) / samples


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--steps-per-block", type=int, default=20)
    parser.add_argument("--rate-hz", type=float, default=10.0)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))

    def block() -> float:
        times = []
        for _ in range(args.steps_per_block):
            start = time.perf_counter()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    interface = backend_interface()
    per_sample = sample_cost_s(SystemSampler(1.0, interface))
    block(), block()  # warm-up
    ratios = []
    for round_ in range(args.rounds):
        medians = {}
        for on in ((False, True) if round_ % 2 == 0 else (True, False)):
            sampler = SystemSampler(1 / args.rate_hz, interface).start() if on else None
            medians[on] = block()
            if sampler is not None:
                sampler.stop()
        # The job runs at its slowest rank's pace: each arm's slowest median, then the ratio.
        slowest = torch.tensor([medians[False], medians[True]])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        ratios.append(slowest[1].item() / slowest[0].item())
    if dist.get_rank() == 0:
        median, low, high = median_with_interval(ratios)
        print(f"one sample: {per_sample * 1e6:.0f} us of CPU on the sampler's thread (interface {interface}); "
              f"at the default 1/s: {per_sample * 100:.3f}% of a core")
        print(f"in one job, sampler at {args.rate_hz:g}/s on / off: {median:.3f} "
              f"(95% interval {low:.3f}-{high:.3f}; {args.rounds} rounds of {args.steps_per_block}-step blocks)")
    dist.barrier()
    end_process(0)  # not destroy_process_group() with a DDP model alive: see gradsync.distributed


if __name__ == "__main__":
    main()
