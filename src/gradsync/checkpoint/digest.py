"""One hash of a model's parameters and buffers, to check that two runs ended bitwise equal."""

from __future__ import annotations

import hashlib

import torch
from torch import nn


def parameters_sha256(model: nn.Module) -> str:
    """One hash of every parameter and buffer, by name: equal hashes mean bitwise-equal models.

    A sharded parameter (a DTensor, under FSDP or tensor parallelism) is hashed whole, so this
    is collective there: every rank calls it.
    """
    from torch.distributed.tensor import DTensor

    sha = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        sha.update(name.encode())
        sha.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()
