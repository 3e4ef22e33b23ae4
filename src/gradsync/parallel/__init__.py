"""How the model is spread over the ranks: DDP, FSDP2, HSDP, tensor parallelism, FSDP + TP,
pipelines (alone or with DDP across them).

`gradsync.setup(parallel=...)` picks one; each is a `Strategy` (gradsync.parallel.base) that
the trainer drives through one interface, so accumulation, mixed precision, agreed skips,
checkpoints and metrics work the same under each. Strategies other than DDP are imported only
when chosen: FSDP's and DTensor's modules cost a DDP run nothing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gradsync.parallel.config import STRATEGIES, ParallelConfig

if TYPE_CHECKING:
    from gradsync.parallel.base import Strategy

# strategy name -> "module:class"
_IMPLEMENTATIONS = {
    "ddp": "gradsync.parallel.ddp:DDPStrategy",
    "fsdp": "gradsync.parallel.fsdp:FSDPStrategy",
    "hsdp": "gradsync.parallel.fsdp:HSDPStrategy",
    "tp": "gradsync.parallel.tp:TPStrategy",
    "fsdp+tp": "gradsync.parallel.tp:FSDPTPStrategy",
    "pp": "gradsync.parallel.pp:PipelineStrategy",
    "pp+ddp": "gradsync.parallel.pp:PipelineDDPStrategy",
}


def make_strategy(name: str, *args: Any, **kwargs: Any) -> Strategy:
    module, _, cls = _IMPLEMENTATIONS[name].partition(":")
    return getattr(importlib.import_module(module), cls)(*args, **kwargs)


__all__ = ["STRATEGIES", "ParallelConfig", "make_strategy"]
