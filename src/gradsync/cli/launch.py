"""Starting workers through torch.distributed.run (torchrun's elastic agent), in this process.

gradsync does not spawn workers by hand: torchrun's agent already handles rendezvous, worker
environment, failure detection (one worker dies, the others are stopped) and restarts.
"""

from __future__ import annotations

import os
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run

from gradsync.distributed import threads_per_worker


def launch_module(module: str, module_args: list[str], nproc_per_node: int) -> int:
    """Run `python -m module *module_args` on `nproc_per_node` local workers; 0 if all succeed."""
    return launch_module_with(["--standalone"], module, module_args, nproc_per_node)


def launch_module_with(torchrun_options: list[str], module: str, module_args: list[str], nproc_per_node: int) -> int:
    """Like `launch_module`, with torchrun's rendezvous options (`--standalone`, or `--nnodes`,
    `--node-rank`, `--master-addr`, `--rdzv-*` ... for several hosts); 0 if all workers succeed."""
    # torchrun would set OMP_NUM_THREADS=1 with a warning; share the cores out explicitly instead
    # (a value the user set wins).
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_worker(nproc_per_node)))
    args = get_args_parser().parse_args(
        [*torchrun_options, "--nproc-per-node", str(nproc_per_node), "-m", module, *module_args]
    )
    try:
        run(args)
    except ChildFailedError as failure:
        rank, error = failure.get_first_failure()
        print(
            f"gradsync: worker rank {rank} failed (exit code {error.exitcode}); its output is above.",
            file=sys.stderr,
        )
        return 1
    return 0
