"""Run a test function in N real processes joined by a Gloo process group.

Each worker gets the environment torchrun gives (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT, ...), imports the test module and calls the function; its return value comes
back as JSON, one per rank. A launch that exceeds its timeout is killed and the test fails
with every rank's output, so a hang never blocks the suite.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from gradsync.distributed import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
WORLD_SIZES = (1, 2, 3)


class WorkersFailed(AssertionError):
    pass


def launch(
    target: Callable[..., Any],
    nproc: int,
    *,
    timeout: float = 90,
    launcher: bool = True,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Call `target(**kwargs)` on `nproc` ranks and return each rank's result (rank order).

    `launcher=False` starts one process with no launcher environment at all, the way a user
    runs `python train.py`.
    """
    assert launcher or nproc == 1, "without a launcher there is exactly one process"
    spec = f"{target.__module__}:{target.__qualname__}"
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="gradsync-test-") as results:
        procs = []
        for rank in range(nproc):
            worker_env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
            worker_env.update(
                PYTHONPATH=str(REPO_ROOT),
                OMP_NUM_THREADS="1",
                GRADSYNC_TEST_RESULTS=results,
            )
            if launcher:
                worker_env.update(
                    RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                    LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                )
            worker_env.update(env or {})
            # Output goes to a file, not a pipe: a chatty worker must not block on a full pipe.
            with open(Path(results) / f"rank{rank}.log", "w") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "tests.harness", spec, json.dumps(kwargs), str(rank)],
                        cwd=results,
                        env=worker_env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        failure = _wait_all(procs, timeout)
        outputs = [(Path(results) / f"rank{r}.log").read_text(errors="replace") for r in range(nproc)]
        if failure:
            report = "\n".join(f"----- rank {r} -----\n{out[-4000:]}" for r, out in enumerate(outputs))
            raise WorkersFailed(f"{spec} on {nproc} process(es): {failure}\n{report}")
        return [json.loads((Path(results) / f"rank{r}.json").read_text()) for r in range(nproc)]


_LAUNCHER_VARS = {
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
}


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> str | None:
    deadline = time.monotonic() + timeout
    failure = None
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            failure = f"timed out after {timeout:.0f} s (a hang): workers killed"
            break
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    if failure is None:
        codes = [proc.returncode for proc in procs]
        if any(codes):
            failure = f"exit codes {codes}"
    return failure


def _worker_main() -> None:
    import importlib

    spec, kwargs, rank = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    module_name, _, name = spec.partition(":")
    target = importlib.import_module(module_name)
    for part in name.split("."):
        target = getattr(target, part)
    result = target(**kwargs)
    out = Path(os.environ["GRADSYNC_TEST_RESULTS"]) / f"rank{rank}.json"
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    from gradsync.distributed import end_process

    _worker_main()
    # A Gloo worker left to Python's interpreter teardown sometimes aborts after finishing.
    end_process(0)
