"""Checkpoints that survive a crash mid-write and resume a run exactly where it stopped.

- `config`: `CheckpointConfig`, the options (where, how often, async, resume).
- `checkpointer`: when to save (agreed by all ranks), saving with DCP, finding what to resume.
- `store`: the folder layout, checksums, the manifest that commits a checkpoint, pruning.
- `safe`: loading without unpickling anything a checkpoint file could smuggle in.
- `digest`: one hash of a model, to check two runs ended bitwise equal.

`checkpointer` (and torch.distributed.checkpoint with it, ~0.8 s to import) is loaded only when
a run checkpoints, so every other gradsync process starts without it.
"""

from typing import Any

from gradsync.checkpoint.config import CheckpointConfig
from gradsync.checkpoint.digest import parameters_sha256
from gradsync.checkpoint.store import CheckpointError, NewerFormatError

_LAZY = ("Checkpointer", "Loaded", "RunState", "StoppedBySignal")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from gradsync.checkpoint import checkpointer

        return getattr(checkpointer, name)
    raise AttributeError(f"module 'gradsync.checkpoint' has no attribute {name!r}")


__all__ = ["CheckpointConfig", "CheckpointError", "NewerFormatError", "parameters_sha256", *_LAZY]
