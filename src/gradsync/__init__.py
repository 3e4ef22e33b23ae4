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
"""

from gradsync.agreement import agree_all, agree_any
from gradsync.comm import CompressionConfig
from gradsync.config import DDPConfig, MetricsConfig, TrainerConfig
from gradsync.data import DistributedLoader, EvalLoader
from gradsync.errors import ConfigError, GradsyncError, PeerError
from gradsync.trainer import MicroStep, Trainer, setup

__version__ = "0.1.0"

__all__ = [
    "CompressionConfig",
    "ConfigError",
    "DDPConfig",
    "DistributedLoader",
    "EvalLoader",
    "GradsyncError",
    "MetricsConfig",
    "MicroStep",
    "PeerError",
    "Trainer",
    "TrainerConfig",
    "agree_all",
    "agree_any",
    "setup",
]
