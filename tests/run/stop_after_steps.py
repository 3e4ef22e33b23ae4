"""Plain torchrun's side of the doctor's differential test: run a script and end each rank right
after its K-th training step, as `gradsync run --doctor-steps K` ends it, with nothing of gradsync.

    python -m torch.distributed.run ... tests/run/stop_after_steps.py K SCRIPT [ARGS]

The script runs as `python SCRIPT ARGS` would run it. A training step is one outermost optimizer
step (one inside another's, like ZeroRedundancyOptimizer's local one, is part of it) that steps a
parameter of a model wrapped in DDP, given to `fully_shard` or to `parallelize_module`, or that
follows a collective the script called since the previous one (hand-written averaging), as the
doctor counts them: rank 0 fitting a model of its own first does not count. After the K-th, the
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

import torch.distributed as dist
import torch.distributed.fsdp as fsdp
import torch.distributed.tensor.parallel as tensor_parallel
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier", "all_gather_object",
               "broadcast_object_list", "gather", "scatter", "send", "recv", "isend", "irecv")


def main() -> None:
    steps, script, args = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    wrapped: set[int] = set()  # ids of the parameters of wrapped, sharded or parallelized models
    communicated = [0]  # collectives the script called
    depth, taken, collectives_at_last_step = 0, 0, 0
    counted: list[bool] = []

    def note(module) -> None:
        for unit in module if isinstance(module, (list, tuple)) else [module]:
            wrapped.update(id(p) for p in unit.parameters())

    original_init = DistributedDataParallel.__init__

    @functools.wraps(original_init)
    def ddp_init(self, *a, **k):
        original_init(self, *a, **k)
        note(self.module)

    DistributedDataParallel.__init__ = ddp_init
    for owner, name in ((fsdp, "fully_shard"), (tensor_parallel, "parallelize_module")):
        original = getattr(owner, name)

        def noting(*a, _original=original, _name=name, **k):
            result = _original(*a, **k)
            note(result if _name == "parallelize_module" else (a[0] if a else k["module"]))
            return result

        setattr(owner, name, functools.wraps(original)(noting))
    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is not None:
            def counting(*a, _original=original, **k):
                communicated[0] += 1
                return _original(*a, **k)

            setattr(dist, name, functools.wraps(original)(counting))

    def before(optimizer, *_: object) -> None:
        nonlocal depth
        depth += 1
        if depth == 1:
            counted.append(any(id(p) in wrapped for group in optimizer.param_groups for p in group["params"])
                           or communicated[0] > collectives_at_last_step)

    def after(*_: object) -> None:
        nonlocal depth, taken, collectives_at_last_step
        depth -= 1
        if depth or not counted or not counted.pop():
            return
        taken += 1
        collectives_at_last_step = communicated[0]
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
