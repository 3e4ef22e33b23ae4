"""What each gradient hook costs the backward pass: gradsync's hooks against the PyTorch hook doing
the same thing, in turns inside one pair of processes.

Whole benchmark launches on a shared 2-core machine swing by several points from one launch to
the next, more than the gap between two PowerSGD implementations. Here every configuration is a
DDP copy of the same ResNet-18 in the same two processes, and they take turns (order reversed
every repetition), so the machine's drift falls on all of them alike. Each rank times its
backward passes, which is where a hook's work and its exposed communication land; a barrier
before each backward keeps one rank's lag out of the other's time.

On loopback (the default) the wire is nearly free, so what separates the configurations is the
hook's own work (packing, casting, dividing, error feedback, extra collectives). Across simulated
hosts the link's wait adds to it. One more copy takes its turns too: `no-comm`, DDP whose hook
hands back the local gradient without communicating. What a configuration's forward and backward
take beyond it is all its communication costs the step, wire and CPU together, and no-comm's
step over the configuration's is the most scaling efficiency that configuration can reach against
DDP without communication in these processes:

    make bench-hook-cost                       # loopback: fp32, fp16, PowerSGD and their peers
    make bench-hook-cost-300mbit               # the same on 2 simulated hosts at 300 Mbit/s (root)
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from gradsync.bench.workloads import ResNet18
from gradsync.comm import CompressionConfig, make_hook
from gradsync.metrics.timing import Clock, CommTimer

PEER_OF = {"fp32": "plain", "fp16": "torch-fp16", "bf16": "torch-bf16", "powersgd": "torch-powersgd"}
REPETITIONS = 8
STEPS_PER_TURN = 3


NO_COMM = "no-comm"


def keep_local_gradient(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP hook that communicates nothing: the ceiling's bucket stays this rank's own gradient."""
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def build(name: str, weights: dict[str, torch.Tensor]) -> DistributedDataParallel:
    module = ResNet18()
    module.load_state_dict(weights)
    model = DistributedDataParallel(module)
    if name == NO_COMM:
        model.register_comm_hook(None, keep_local_gradient)
    elif name == "torch-fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name == "torch-bf16":
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif name == "torch-powersgd":
        # Compressing from the first step, as gradsync's below: the warm-up turn is left out anyway.
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2,
                                            use_error_feedback=True, warm_start=True)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif name != "plain":
        # As the trainer does: gradsync's hook (none for fp32) inside the timer that meters it.
        hook = None
        if name != "fp32":
            hook = make_hook(CompressionConfig(name=name, powersgd_start_step=0) if name == "powersgd"
                             else CompressionConfig(name=name))
            hook.bind(module)
        CommTimer(Clock(torch.device("cpu")), hook).register(model, process_group=None)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="fp32,fp16", help="gradsync configurations, each measured beside its peer")
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    configs = args.configs.split(",")
    unknown = [c for c in configs if c not in PEER_OF]
    if unknown:
        parser.error(f"no peer for {unknown}; choose from {sorted(PEER_OF)}")
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    weights = ResNet18().state_dict()
    images, labels = torch.randn(args.batch_size, 3, 32, 32), torch.randint(0, 10, (args.batch_size,))
    names = [NO_COMM, *(name for config in configs for name in (PEER_OF[config], config))]
    models = {name: build(name, weights) for name in names}
    backward: dict[str, list[float]] = {name: [] for name in models}
    step: dict[str, list[float]] = {name: [] for name in models}  # forward and backward
    for repetition in range(REPETITIONS):
        order = list(models.items()) if repetition % 2 == 0 else list(reversed(models.items()))
        for name, model in order:
            for _ in range(STEPS_PER_TURN):
                dist.barrier()
                started = time.perf_counter()
                loss = torch.nn.functional.cross_entropy(model(images), labels)
                forward_s = time.perf_counter() - started
                dist.barrier()
                started = time.perf_counter()
                loss.backward()
                backward[name].append(time.perf_counter() - started)
                step[name].append(forward_s + backward[name][-1])
                model.zero_grad()
    if dist.get_rank() == 0:
        # The first turn of each warms up allocations (and PyTorch's PowerSGD's plain steps).
        median = {name: statistics.median(measured[STEPS_PER_TURN:]) for name, measured in backward.items()}
        median_step = {name: statistics.median(measured[STEPS_PER_TURN:]) for name, measured in step.items()}
        print(f"{'gradsync':<10} {'backward':>10}   {'peer':<15} {'backward':>10}   gradsync / peer")
        for config in configs:
            peer = PEER_OF[config]
            own = median[config]
            print(f"{config:<10} {1e3 * own:8.1f} ms   {peer:<15} {1e3 * median[peer]:8.1f} ms   {own / median[peer]:.3f}")
        ceiling = median_step[NO_COMM]
        print(f"\n{NO_COMM} (DDP, communicating nothing): forward and backward {1e3 * ceiling:.1f} ms")
        print(f"{'config':<15} {'forward+backward':>16}   {'over no-comm':>12}   {'no-comm / it':>12}")
        for name in names[1:]:
            print(f"{name:<15} {1e3 * median_step[name]:13.1f} ms   {1e3 * (median_step[name] - ceiling):+9.1f} ms"
                  f"   {ceiling / median_step[name]:12.3f}")


if __name__ == "__main__":
    main()
