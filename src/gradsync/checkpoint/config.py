"""Typed options of checkpointing, validated before any process group exists."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from gradsync.errors import ConfigError


@dataclass(frozen=True)
class CheckpointConfig:
    """When and where a run saves itself, and whether it resumes.

    dir: the checkpoint folder, on a filesystem every node sees; None turns checkpointing off.
    every_steps: save every N optimizer steps.
    every_minutes: save when this much time passed since the last save (rank 0's clock decides,
        so every rank saves at the same step).
    keep: committed checkpoints kept; older ones are deleted once a newer one is committed.
    async_save: write in the background (DCP async save) while training continues; the state
        is copied to memory first, so the cost on the training thread is that copy.
    on_sigterm: on SIGTERM (preemption, the launcher stopping the job), finish the current
        optimizer step, save, and exit with code 143.
    resume: "auto" continues from the newest valid checkpoint in `dir` (or starts fresh when
        there is none); a path resumes from that checkpoint folder; None starts fresh.
    overwrite: delete the checkpoints in `dir` that this run does not continue from (all of
        them when it starts fresh, the newer ones when it resumes from an older folder of
        `dir`) before training starts. Without it such a folder is refused: checkpoints of two
        runs must never mix, or keep-newest would delete the new run's saves and a later
        resume="auto" would continue the old run.
    """

    dir: str | None = None
    every_steps: int | None = None
    every_minutes: float | None = None
    keep: int = 3
    async_save: bool = False
    on_sigterm: bool = True
    resume: str | None = None
    overwrite: bool = False

    def __post_init__(self) -> None:
        if self.every_steps is not None and (not isinstance(self.every_steps, int) or self.every_steps < 1):
            raise ConfigError(f"checkpoint.every_steps={self.every_steps!r}: use an integer >= 1, or None.")
        if self.every_minutes is not None and not (
            isinstance(self.every_minutes, (int, float)) and self.every_minutes > 0
        ):
            raise ConfigError(f"checkpoint.every_minutes={self.every_minutes!r}: use a positive number, or None.")
        if not isinstance(self.keep, int) or self.keep < 1:
            raise ConfigError(
                f"checkpoint.keep={self.keep!r}: keep at least 1 checkpoint (the newest), so a "
                "failure always has one to resume from."
            )
        if self.dir is None and (self.every_steps or self.every_minutes or self.resume or self.overwrite):
            raise ConfigError(
                "checkpoint options are set but checkpoint.dir is not: say where checkpoints go "
                "(a folder every node can read and write)."
            )
        if self.resume is not None and not isinstance(self.resume, (str, os.PathLike)):
            raise ConfigError(f"checkpoint.resume={self.resume!r}: use 'auto', a checkpoint folder, or None.")
        for name in ("dir", "resume"):  # compared across ranks, and written into manifests, as text
            if isinstance(getattr(self, name), os.PathLike):
                object.__setattr__(self, name, os.fspath(getattr(self, name)))
        if self.resume is not None and self.resume != "auto" and not Path(self.resume).is_dir():
            # A word like "latest" would otherwise be taken for a folder name.
            raise ConfigError(
                f"checkpoint.resume={str(self.resume)!r} is neither 'auto' nor an existing checkpoint folder. Use "
                "'auto' to continue from the newest valid checkpoint in checkpoint.dir (a fresh start when there "
                "is none), or the folder of one checkpoint, e.g. 'DIR/step-000000120'."
            )
        if not isinstance(self.overwrite, bool):
            raise ConfigError(f"checkpoint.overwrite={self.overwrite!r}: use True or False.")

    @property
    def enabled(self) -> bool:
        return self.dir is not None
