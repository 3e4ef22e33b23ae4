"""Plain torchrun's side of the doctor's differential test: run a script and end each rank right
after its K-th training step, as `gradsync run --doctor-steps K` ends it, with nothing of gradsync.

    python -m torch.distributed.run ... tests/run/stop_after_steps.py K SCRIPT [ARGS]

The script runs as `python SCRIPT ARGS` would run it. A training step is one outermost optimizer
step (one inside another's, like ZeroRedundancyOptimizer's local one, is part of it) that steps a
parameter of a model wrapped in DDP, given to `fully_shard` or to `parallelize_module`, or that
follows, since the previous one, a reduction of a floating-point tensor the size of one of its
parameters or more, up to all of them (hand-written averaging), a DDP model's forward (its
gradients averaged: another model trained beside it), or tensors sent or received point to point
(a pipeline), as the doctor counts them: rank 0 fitting a model of its own first does not count,
even after a barrier or an object broadcast. After the K-th, the
rank ends where it stands as the doctor's stop does (gradsync.distributed.exit_now, written out
here so that this side imports nothing of gradsync): the script's exit handlers, a garbage
collection, its output flushed, then exit code 0. The patches only count; each call goes on as it came.
"""

from __future__ import annotations

import atexit
import functools
import gc
import os
import runpy
import sys

import torch
import torch.distributed as dist
import torch.distributed.fsdp as fsdp
import torch.distributed.tensor.parallel as tensor_parallel
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

# The reductions noted where the script (or FSDP2, under torch 2.13's names) calls them: the size of
# the floating-point tensor each one reduced.
REDUCTIONS = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single")
# Point to point, noted as a pipeline's traffic; isend and irecv are left alone (torch compares them
# by identity when they are given to P2POp), and batch_isend_irecv carries those.
POINT_TO_POINT = ("send", "recv", "batch_isend_irecv")


def main() -> None:
    steps, script, args = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    wrapped: set[int] = set()  # ids of the parameters of wrapped, sharded or parallelized models
    reduced: list[int] = []  # element counts of the floating-point tensors reduced since the last counted step
    exchanged = [0]  # point-to-point calls and DDP forwards that average gradients, since the last counted step
    depth, taken = 0, 0
    counted: list[bool] = []

    def note(module) -> None:
        for unit in module if isinstance(module, (list, tuple)) else [module]:
            wrapped.update(id(p) for p in unit.parameters())

    original_init, original_forward = DistributedDataParallel.__init__, DistributedDataParallel.forward

    @functools.wraps(original_init)
    def ddp_init(self, *a, **k):
        original_init(self, *a, **k)
        note(self.module)

    @functools.wraps(original_forward)
    def ddp_forward(self, *a, **k):
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            exchanged[0] += 1  # its backward averages the model's gradients
        return original_forward(self, *a, **k)

    DistributedDataParallel.__init__ = ddp_init
    DistributedDataParallel.forward = ddp_forward
    for owner, name in ((fsdp, "fully_shard"), (tensor_parallel, "parallelize_module")):
        original = getattr(owner, name)

        def noting(*a, _original=original, _name=name, **k):
            result = _original(*a, **k)
            note(result if _name == "parallelize_module" else (a[0] if a else k["module"]))
            return result

        setattr(owner, name, functools.wraps(original)(noting))
    for name in REDUCTIONS:
        original = getattr(dist, name, None)
        if original is not None:
            def noting(*a, _original=original, _name=name, **k):
                tensor = (a[1] if len(a) > 1 else k.get("input")) if _name.startswith("reduce_scatter") else (
                    a[0] if a else k.get("tensor"))
                if isinstance(tensor, torch.Tensor) and (tensor.is_floating_point() or tensor.is_complex()):
                    reduced.append(tensor.numel())
                return _original(*a, **k)

            setattr(dist, name, functools.wraps(original)(noting))
    for name in POINT_TO_POINT:
        original = getattr(dist, name, None)
        if original is not None:
            def exchanging(*a, _original=original, **k):
                exchanged[0] += 1
                return _original(*a, **k)

            setattr(dist, name, functools.wraps(original)(exchanging))

    def before(optimizer, *_: object) -> None:
        nonlocal depth
        depth += 1
        if depth == 1:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            sizes = [p.numel() for p in params] or [0]
            counted.append(any(id(p) in wrapped for p in params) or exchanged[0] > 0
                           or any(min(sizes) <= n <= sum(sizes) for n in reduced))

    def after(*_: object) -> None:
        nonlocal depth, taken
        depth -= 1
        if depth or not counted or not counted.pop():
            return
        taken += 1
        reduced.clear()
        exchanged[0] = 0
        if taken == steps:
            try:
                atexit._run_exitfuncs()
                gc.collect()
            finally:
                for stream in (sys.stdout, sys.stderr):
                    try:
                        stream.flush()
                    except (OSError, ValueError):
                        pass
                os._exit(0)

    register_optimizer_step_pre_hook(before)
    register_optimizer_step_post_hook(after)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(os.path.abspath(script), run_name="__main__")


if __name__ == "__main__":
    main()
