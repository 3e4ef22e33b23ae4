"""Checkpoints that survive a crash mid-write and resume a run exactly where it stopped.

- `config`: `CheckpointConfig`, the options (where, how often, async, resume).
- `checkpointer`: when to save (agreed by all ranks), saving with DCP, finding what to resume.
- `store`: the folder layout, checksums, the manifest that commits a checkpoint, pruning.
- `safe`: loading without unpickling anything a checkpoint file could smuggle in.
"""

from gradsync.checkpoint.checkpointer import Checkpointer, Loaded, RunState, StoppedBySignal, parameters_sha256
from gradsync.checkpoint.config import CheckpointConfig
from gradsync.checkpoint.store import CheckpointError, NewerFormatError

__all__ = ["CheckpointConfig", "CheckpointError", "Checkpointer", "Loaded", "NewerFormatError", "RunState", "StoppedBySignal", "parameters_sha256"]
