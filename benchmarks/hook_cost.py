"""What a gradient hook costs the backward pass on a link too fast to hide it: gradsync's fp16
against PyTorch's `fp16_compress_hook` and DDP's own all-reduce, on 2 loopback ranks.

On loopback the wire is nearly free, so what separates the configurations is the hook's own work
(packing, casting, dividing, the extra collective of the uncompressed part). Each rank times its
backward passes; the configurations take turns (order reversed every repetition) so the machine's
drift falls on all of them alike. Run: `make bench-hook-cost`.
"""

import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from gradsync.bench.workloads import ResNet18
from gradsync.comm import CompressionConfig, make_hook

REPETITIONS = 8
STEPS_PER_TURN = 3


def build(name: str) -> DistributedDataParallel:
    model = DistributedDataParallel(ResNet18())
    if name == "torch-fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name == "fp16":
        model.register_comm_hook(None, make_hook(CompressionConfig(name="fp16")))
    return model


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    images, labels = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    models = {name: build(name) for name in ("torch-fp16", "fp16", "fp32")}
    times: dict[str, list[float]] = {name: [] for name in models}
    for repetition in range(REPETITIONS):
        order = list(models.items()) if repetition % 2 == 0 else list(reversed(models.items()))
        for name, model in order:
            for _ in range(STEPS_PER_TURN):
                loss = torch.nn.functional.cross_entropy(model(images), labels)
                dist.barrier()  # both ranks start backward together: the wait is the hook's, not the peer's
                started = time.perf_counter()
                loss.backward()
                times[name].append(time.perf_counter() - started)
                model.zero_grad()
    if dist.get_rank() == 0:
        reference = statistics.median(times["torch-fp16"][STEPS_PER_TURN:])
        print("config       backward (median)  vs torch-fp16")
        for name, measured in times.items():
            median = statistics.median(measured[STEPS_PER_TURN:])  # the first turn warms up allocations
            print(f"{name:<12} {1e3 * median:10.1f} ms {median / reference:14.3f}")


if __name__ == "__main__":
    main()
