"""Options of `gradsync run` that go beyond torchrun's, typed and checked at the command line.

The launcher writes them to the run directory and passes that file's path on each worker's
command line, so workers are configured by something the user can read, not by hidden
environment variables.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradsync.errors import ConfigError
from gradsync.profiling.capture import parse_profile_steps
from gradsync.rundir import RunDir, read_json, write_json


# The attempt a worker belongs to: the launcher counts every start of this node's workers (a
# restart after a failure, and one torchrun's agent makes when an elastic job's nodes change,
# which leaves TORCHELASTIC_RESTART_COUNT as it was), so no two groups share an attempt's folder.
# Set by gradsync run for its own workers; without it a worker takes TORCHELASTIC_RESTART_COUNT.
ATTEMPT_ENV = "GRADSYNC_ATTEMPT"

# How long ranks may wait in a collective for a rank that keeps working without progress before
# the job is stopped: NCCL's own default timeout. On NCCL a job kept busy that long fails then
# anyway (the waiting ranks' collectives time out), so stopping it costs nothing and names the
# line; on Gloo (30 min) it ends an endless loop 20 minutes sooner. A rank that legitimately
# works alone longer (an evaluation of its own while the others wait at a barrier) needs a
# longer --busy-timeout, as it needs a longer process-group timeout on NCCL.
DEFAULT_BUSY_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class RunOptions:
    """What the diagnosing launcher watches for.

    `stall_timeout_s`: a job in which no rank makes progress for this long is stopped and
    diagnosed; well below the backend's own timeout (Gloo: 30 min, NCCL: 10 min), above the
    longest legitimate pause (evaluation or checkpointing while the other ranks wait). A rank
    that keeps working (CPU in its process tree) is not stalled: see `busy_timeout_s`.
    `busy_timeout_s`: ranks waiting in a collective for a rank that keeps working without real
    progress are noted at the stall timeout and stopped after this long; None: DEFAULT_BUSY_TIMEOUT_S,
    or the stall timeout where that is longer.
    `straggler_ratio`: a rank whose typical lateness at collectives exceeds this share of the
    typical step is reported as a straggler (when also over `straggler_min_s`).
    `faults`: the `--inject-fault` specs, as checked canonical text (see gradsync.run.faults).
    `doctor_steps`: with `--doctor-steps K`, every rank runs the script with the script check's
    instrumentation (gradsync.run.script_facts) and stops itself after its K-th optimizer step;
    None for a plain run, which installs none of it.
    `script_probe`: with `doctor_steps`, the module whose watches every rank carries and whose
    rules judge their facts (gradsync.run.moments.ScriptProbe: the doctor's script check, which
    the command line gives the launcher); the workers import it by this name.
    `doctor_checks`: with `--doctor-checks NAME,...`, the checks of the probe to run (its names,
    checked by the launcher); None: every check.
    `probe_config`: what else the run asks of the probe's watches, JSON-ready (the doctor's second
    pass: a step window to trace line by line); None: nothing.
    `record_buckets`: record each DDP gradient bucket through a Python comm hook and check every
    gradient before averaging (names the rank and parameters where NaN/inf started, at ~1.5-2 ms
    per step); otherwise DDP keeps its C++ reduction, recorded per backward pass with the loss
    checked. The script check always records buckets: it is short and wants the detail.
    `profile_steps`: "A:B" profiles optimizer steps A..B of every rank with torch.profiler
    (RUN_DIR/profile/, see gradsync.profiling); steps are counted by the optimizers' step calls.
    `flight_recorder_entries`: the size of PyTorch's Flight Recorder buffer turned on in every
    worker (TORCH_FR_BUFFER_SIZE for Gloo and NCCL; a value set in the environment
    wins), dumped when a rank is quiet for half the stall timeout and when it exits; 0: off.
    `show_backend_logs`: also print the backend libraries' own log lines (Gloo, NCCL, c10, the
    profiler) on the console; they always go to each rank's log (see gradsync.run.output).
    """

    run_dir: Path
    stall_timeout_s: float = 120.0
    busy_timeout_s: float | None = None
    ring_size: int = 256
    straggler_ratio: float = 0.2
    straggler_min_s: float = 0.05
    faults: tuple[str, ...] = ()
    doctor_steps: int | None = None
    script_probe: str | None = None
    doctor_checks: list[str] | None = None
    probe_config: dict[str, Any] | None = None
    record_buckets: bool = False
    profile_steps: str | None = None
    show_backend_logs: bool = False
    flight_recorder_entries: int = 2000

    def __post_init__(self) -> None:
        if not self.stall_timeout_s >= 1:
            raise ConfigError(
                f"--stall-timeout {self.stall_timeout_s:g}: give at least 1 second (the default, "
                "120 s, leaves room for evaluation or checkpointing on one rank)."
            )
        if self.busy_timeout_s is None:
            object.__setattr__(self, "busy_timeout_s", max(DEFAULT_BUSY_TIMEOUT_S, self.stall_timeout_s))
        if not self.busy_timeout_s >= self.stall_timeout_s:
            raise ConfigError(
                f"--busy-timeout {self.busy_timeout_s:g}: give at least the stall timeout "
                f"({self.stall_timeout_s:g} s): a rank that works is noted at the stall timeout and stopped at the "
                f"busy timeout, never sooner than an idle one (the default, {DEFAULT_BUSY_TIMEOUT_S:g} s, is NCCL's own timeout)."
            )
        if self.ring_size < 16:
            raise ConfigError(f"ring_size={self.ring_size}: keep at least 16 collectives per rank.")
        if not 0 < self.straggler_ratio < 10:
            raise ConfigError(f"straggler_ratio={self.straggler_ratio}: use a share of the step, e.g. 0.2.")
        if isinstance(self.flight_recorder_entries, bool) or not isinstance(self.flight_recorder_entries, int) or self.flight_recorder_entries < 0:
            raise ConfigError(
                f"--flight-recorder {self.flight_recorder_entries}: give the number of entries to keep per rank "
                "(e.g. 2000), or 0 to turn PyTorch's Flight Recorder off."
            )
        if self.profile_steps is not None:
            parse_profile_steps(self.profile_steps)
        steps = self.doctor_steps
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ConfigError(
                f"--doctor-steps {steps}: give the number of optimizer steps to check, a whole "
                "number of at least 1 (e.g. 20: enough for the checks, short enough to run before every job)."
            )
        if steps is not None and self.script_probe is None:
            raise ConfigError(f"--doctor-steps {steps}: this launch was given no script check to run (run `gradsync doctor --steps {steps}`).")

    @property
    def snapshot_interval_s(self) -> float:
        """How often workers publish their state: often enough to detect a stall promptly."""
        return min(1.0, self.stall_timeout_s / 5)

    def save(self) -> Path:
        path = RunDir(self.run_dir).options
        data = dataclasses.asdict(self)
        data["run_dir"] = str(self.run_dir)
        write_json(path, data)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "RunOptions":
        data = read_json(Path(path))
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: not a gradsync run options file (written by `gradsync run`).")
        known = {f.name for f in dataclasses.fields(cls)}
        data = {k: v for k, v in data.items() if k in known}
        data["run_dir"] = Path(data["run_dir"])
        data["faults"] = tuple(data.get("faults", ()))
        return cls(**data)
