"""Firing injected faults inside a worker of `gradsync run`, at the steps training reports.

The worker arms the faults meant for its rank and attempt (`arm`), which listens to
`gradsync.events`; the others are dropped. What a step is:
- gradsync's Trainer claims the steps and reports optimizer step n (counted from 1), and its
  checkpointer the checkpoint of step n once this rank's data is written and before the
  checkpoint is committed;
- in any other script, step n is the n-th backward pass whose gradients DDP synchronises: the
  run recorder reports it when that pass hands its last
  gradient bucket to the reduction (passes under `no_sync()` do not count, nor do those of a
  model with a C++ built-in comm hook, which the recorder cannot see).
A fault fires when a rank reaches exactly its step; a job resumed past that step never fires
it. Each fault targets one attempt (default 0, the first), so the job that torchrun's agent
restarts after the fault runs clean.

Before acting, the rank leaves a record in the run directory (so the diagnosis says the
failure was injected, not a bug) and prints one line to stderr.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
from pathlib import Path

from gradsync import events
from gradsync.distributed import exit_on_the_spot
from gradsync.run.faults import FaultSpec
from gradsync.rundir import write_json


class FaultTrigger:
    """The faults of this rank and attempt, by (at, step), fired when training reaches them."""

    def __init__(self, faults: dict[tuple[str, int], FaultSpec], record_path: Path | None) -> None:
        self.faults = faults
        self.record_path = record_path

    def step(self, step: int) -> None:
        self._reach("step", step)

    def checkpoint(self, step: int) -> None:
        self._reach("checkpoint", step)

    def _reach(self, at: str, step: int) -> None:
        spec = self.faults.get((at, step))
        if spec is not None:
            fire(spec, self.record_path)


def arm(specs: list[FaultSpec] | tuple[FaultSpec, ...], rank: int, attempt: int, record_path: Path | None = None) -> None:
    """Listen for the steps of the faults meant for this `rank` on this `attempt` (none: no listener).

    `record_path`: where a firing fault leaves its record for the launcher's diagnosis.
    """
    mine = {(s.at, s.step): s for s in specs if s.rank == rank and s.attempt == attempt}
    events.listen(FaultTrigger(mine, record_path) if mine else None)


def fire(spec: FaultSpec, record_path: Path | None) -> None:
    """Leave the record (so the diagnosis says the failure was injected), say so, and act."""
    if record_path is not None:
        write_json(record_path, {**dataclasses.asdict(spec), "spec": str(spec), "time": time.time(), "pid": os.getpid()})
    print(f"gradsync: injected fault (--inject-fault {spec}): {spec.describe()}", file=sys.stderr, flush=True)
    if spec.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif spec.action == "exit":
        exit_on_the_spot(spec.code)
    elif spec.action == "stop":
        # Frozen whole, threads included, as a process in an uninterruptible wait or on a
        # suspended machine: only the stall detector can notice. A SIGCONT lets it go on.
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    # hang: this thread never returns, as with a deadlocked data loader or file system.
    while True:
        time.sleep(3600)
