"""Run a test function in N real processes joined by a Gloo process group.

Each worker gets the environment torchrun gives (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT, ...), imports the test module and calls the function; its return value comes
back as JSON, one per rank. A launch that exceeds its timeout is killed and the test fails
with every rank's output, so a hang never blocks the suite.

Workers are forked from a server process that imported torch and gradsync once (Python's
forkserver): a fresh interpreter spends ~3.5 s of CPU importing them, which across the suite's
hundreds of workers was minutes of a 2-core machine. Each worker is still its own process, with
its own environment, working folder, session and output file, started before any thread.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from gradsync.distributed import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
WORLD_SIZES = (1, 2, 3)
# Imported once by the server the workers are forked from (what every worker imports anyway).
PRELOADED = ["torch", "torch.distributed", "torch.nn.parallel", "gradsync.trainer"]
_context: Any = None


def fixture_timeout_s(runs: int, at_a_time: int, run_timeout_s: float) -> float:
    """The hang guard of a test whose fixture makes `runs` guarded runs, `at_a_time` at a time.

    It is what the runs' own guards add up to: a fixed bound below that sum fails a healthy fixture
    on a loaded machine while every run is still inside its own guard (the zoo's 900 s did, at
    load 15, with 32 of its 44 jobs done)."""
    return run_timeout_s * -(-runs // at_a_time)


def _forkserver() -> Any:
    global _context
    if _context is None:
        # torch reads OMP_NUM_THREADS when it sets up its thread pool: the server's is the workers'.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOADED)
    return _context


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
    context = _forkserver()
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
            proc = context.Process(target=_worker_main, args=(spec, kwargs, rank, worker_env, results), daemon=False)
            proc.start()
            procs.append(proc)
        failure = _wait_all(procs, timeout)
        outputs = [(Path(results) / f"rank{r}.log").read_text(errors="replace") for r in range(nproc)]
        if failure:
            report = "\n".join(f"----- rank {r} -----\n{out[-4000:]}" for r, out in enumerate(outputs))
            raise WorkersFailed(f"{spec} on {nproc} process(es): {failure}\n{report}")
        return [json.loads((Path(results) / f"rank{r}.json").read_text()) for r in range(nproc)]


_LAUNCHER_VARS = {
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
}


def _wait_all(procs: list[Any], timeout: float) -> str | None:
    deadline = time.monotonic() + timeout
    failure = None
    for proc in procs:
        proc.join(timeout=max(0.1, deadline - time.monotonic()))
        if proc.exitcode is None:
            failure = f"timed out after {timeout:.0f} s (a hang): workers killed"
            break
    for proc in procs:
        if proc.exitcode is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the worker and anything it started
            except ProcessLookupError:
                pass
        proc.join()
    if failure is None:
        codes = [proc.exitcode for proc in procs]
        if any(codes):
            failure = f"exit codes {codes}"
    return failure


def _worker_main(spec: str, kwargs: dict[str, Any], rank: int, env: dict[str, str], results: str) -> None:
    """In the forked worker: become a process of its own (session, environment, folder, output), run."""
    import importlib

    from gradsync.distributed import end_process

    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(results)
    # Output goes to a file, not a pipe: a chatty worker must not block on a full pipe.
    log = os.open(Path(results) / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    sys.path.insert(0, str(REPO_ROOT))
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    try:
        module_name, _, name = spec.partition(":")
        target = importlib.import_module(module_name)
        for part in name.split("."):
            target = getattr(target, part)
        result = target(**kwargs)
        (Path(results) / f"rank{rank}.json").write_text(json.dumps(result))
    except BaseException:
        import traceback

        traceback.print_exc()
        end_process(1)
    # A Gloo worker left to Python's interpreter teardown sometimes aborts after finishing.
    end_process(0)
