"""Checkpoint contents load without unpickling anything but DCP's own index classes."""

from __future__ import annotations

import math
import os
import pickle

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from gradsync.checkpoint import safe
from gradsync.errors import GradsyncError


def test_plain_state_round_trips_through_tensors():
    state = {
        "step": 7, "lr": 0.5, "name": "adamw", "flags": [True, None], "inf": math.inf,
        "betas": (0.9, 0.999), 3: {"momentum": torch.arange(4.0)}, (1, 2): "tuple key",
        "numpy": np.arange(3, dtype=np.uint32), "scalar": np.float64(2.5),
    }
    encoded = safe.encode(state)
    assert all(isinstance(v, torch.Tensor) for v in encoded.values())
    decoded = safe.decode(encoded)
    assert decoded["step"] == 7 and isinstance(decoded["step"], int)
    assert decoded["betas"] == (0.9, 0.999) and decoded[(1, 2)] == "tuple key"
    assert torch.equal(decoded[3]["momentum"], torch.arange(4.0))
    assert decoded["numpy"].dtype == np.uint32 and decoded["numpy"].tolist() == [0, 1, 2]
    assert decoded["inf"] == math.inf and decoded["scalar"] == 2.5 and decoded["flags"] == [True, None]


def test_objects_that_need_pickle_are_refused_when_saving():
    with pytest.raises(GradsyncError, match=r"state\['hook'\]: a function is not plain state"):
        safe.encode({"hook": lambda: None})


class _RunsCode:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_a_forged_index_is_refused_without_running_it(tmp_path):
    dcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "ok", no_dist=True)
    assert safe.read_metadata(tmp_path / "ok" / ".metadata").state_dict_metadata["w"].size == torch.Size([2])

    marker = tmp_path / "code-ran"
    forged = tmp_path / ".metadata"
    forged.write_bytes(pickle.dumps(_RunsCode(str(marker))))
    with pytest.raises(safe.UnsafeCheckpointError, match="posix.mkdir"):
        safe.read_metadata(forged)
    assert not marker.exists()


def test_pickled_items_are_refused_when_loading(tmp_path):
    dcp.save({"blob": {"any": "object"}}, checkpoint_id=tmp_path, no_dist=True)  # DCP pickles non-tensors
    target = {"blob": {"any": "object"}}
    with pytest.raises(safe.UnsafeCheckpointError, match="blob"):
        safe.load(target, tmp_path)
