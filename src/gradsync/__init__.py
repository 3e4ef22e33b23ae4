"""gradsync: PyTorch data-parallel training that does not hang, waste the network or lose progress.

The public API is small:

    trainer = gradsync.setup(accumulation_steps=4, precision="bf16", max_grad_norm=1.0)
    model, optimizer, loader = trainer.prepare(model, optimizer, dataset, batch_size=64)
    for epoch in trainer.epochs(10):
        for x, y in loader:
            with trainer.step() as step:
                loss = loss_fn(model(x), y)
                step.backward(loss)
            trainer.log(loss=loss)
    trainer.close()

Its names are loaded on first use: `gradsync run`, the doctor and the report import parts of
the package without paying for the trainer.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gradsync.version import __version__

# public name -> the module that owns it
_PUBLIC = {
    "agree_all": "gradsync.agreement",
    "agree_any": "gradsync.agreement",
    "CompressionConfig": "gradsync.comm.compression",
    "PeriodicSyncConfig": "gradsync.comm.periodic",
    "TrainerConfig": "gradsync.config",
    "DDPConfig": "gradsync.ddp",
    "MetricsConfig": "gradsync.metrics.config",
    "DistributedLoader": "gradsync.data",
    "EvalLoader": "gradsync.data",
    "ConfigError": "gradsync.errors",
    "GradsyncError": "gradsync.errors",
    "PeerError": "gradsync.errors",
    "MicroStep": "gradsync.trainer",
    "Trainer": "gradsync.trainer",
    "setup": "gradsync.trainer",
}

if TYPE_CHECKING:
    from gradsync.agreement import agree_all, agree_any
    from gradsync.comm.compression import CompressionConfig
    from gradsync.comm.periodic import PeriodicSyncConfig
    from gradsync.config import TrainerConfig
    from gradsync.data import DistributedLoader, EvalLoader
    from gradsync.ddp import DDPConfig
    from gradsync.errors import ConfigError, GradsyncError, PeerError
    from gradsync.metrics.config import MetricsConfig
    from gradsync.trainer import MicroStep, Trainer, setup


def __getattr__(name: str) -> Any:
    owner = _PUBLIC.get(name)
    if owner is None:
        raise AttributeError(f"module 'gradsync' has no attribute {name!r}")
    value = getattr(importlib.import_module(owner), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])


__all__ = ["__version__", *sorted(_PUBLIC)]
