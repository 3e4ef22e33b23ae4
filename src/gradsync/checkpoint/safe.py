"""Checkpoint contents that load without unpickling anything a stranger could have written.

`torch.distributed.checkpoint` (DCP) keeps tensors in raw files, but it pickles two things: its
`.metadata` index, read back with a plain `pickle.load`, and every non-tensor value of the
state dict (numbers, strings, the optimizer's hyper-parameters), read back with
`torch.load(weights_only=False)`. A checkpoint from an untrusted place could run code through
either. gradsync closes both doors:

- every value it hands DCP is a tensor: plain state (nested dicts, lists, numbers, strings,
  NumPy arrays) is split by `encode` into its tensors and a JSON skeleton stored as bytes in a
  uint8 tensor, and rebuilt by `decode`;
- `.metadata` is read by an unpickler that resolves only DCP's own metadata classes, torch
  dtypes and sizes (`SafeFileSystemReader`), and a planner that refuses non-tensor items
  (`TensorOnlyLoadPlanner`), so a forged index cannot smuggle a pickle in either.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import pathlib
import pickle
import warnings
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from gradsync.errors import GradsyncError

JSON_KEY = "json"


class UnsafeCheckpointError(GradsyncError):
    """The checkpoint asks to unpickle something other than DCP's own metadata."""


def encode(state: Any) -> dict[str, torch.Tensor]:
    """Split plain state into tensors: {"json": skeleton bytes, "0": tensor, "1": tensor, ...}.

    Dict keys keep their type (an optimizer's integer keys stay integers); tuples stay tuples.
    Anything else (a function, an arbitrary object) is refused: it could not be loaded safely.
    """
    tensors: dict[str, torch.Tensor] = {}

    def walk(value: Any, where: str) -> Any:
        if isinstance(value, torch.Tensor):
            key = str(len(tensors))
            tensors[key] = value.detach()
            return {"__tensor__": key}
        if isinstance(value, np.ndarray):
            key = str(len(tensors))
            tensors[key] = torch.from_numpy(np.ascontiguousarray(value))
            return {"__ndarray__": key}
        if isinstance(value, np.generic):
            return value.item()
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, (list, tuple)):
            items = [walk(v, f"{where}[{i}]") for i, v in enumerate(value)]
            return {"__tuple__": items} if isinstance(value, tuple) else items
        if isinstance(value, dict):
            return {"__dict__": [[walk(k, f"{where} key"), walk(v, f"{where}[{k!r}]")] for k, v in value.items()]}
        raise GradsyncError(
            f"cannot checkpoint {where}: a {type(value).__name__} is not plain state. Checkpoints hold "
            "tensors, NumPy arrays, numbers, strings, lists, tuples and dicts only, so they load without "
            "running code; make its state_dict() return those."
        )

    skeleton = walk(state, "state")
    text = json.dumps(skeleton, allow_nan=True).encode()
    return {JSON_KEY: torch.frombuffer(bytearray(text), dtype=torch.uint8), **tensors}


def decode(encoded: dict[str, torch.Tensor]) -> Any:
    """The state `encode` split, rebuilt (tensors as loaded, NumPy arrays as arrays)."""
    skeleton = json.loads(bytes(encoded[JSON_KEY].tolist()).decode())

    def build(value: Any) -> Any:
        if isinstance(value, list):
            return [build(v) for v in value]
        if isinstance(value, dict):
            if "__tensor__" in value:
                return encoded[value["__tensor__"]]
            if "__ndarray__" in value:
                return encoded[value["__ndarray__"]].numpy()
            if "__tuple__" in value:
                return tuple(build(v) for v in value["__tuple__"])
            return {build(k): build(v) for k, v in value["__dict__"]}
        return value

    return build(skeleton)


# Every global DCP's metadata pickle refers to (torch 2.4 - 2.13), and nothing that runs code.
_METADATA_MODULES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if name in _METADATA_MODULES.get(module, ()):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"the checkpoint's .metadata refers to {module}.{name}, which is not part of a "
            "torch.distributed.checkpoint index; gradsync refuses to load it (it could run code). "
            "Only load checkpoints written by gradsync or torch.distributed.checkpoint."
        )


def read_metadata(path: pathlib.Path) -> Metadata:
    """DCP's `.metadata` index at `path`, unpickled with only DCP's own classes allowed."""
    with open(path, "rb") as stream:
        data = stream.read()
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except UnsafeCheckpointError:
        raise
    except Exception as error:
        raise GradsyncError(f"{path} is not a readable checkpoint index ({type(error).__name__}: {error}).") from error
    if not isinstance(metadata, Metadata):
        raise GradsyncError(f"{path} is not a checkpoint index (it holds a {type(metadata).__name__}).")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, with its index read by the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        metadata = read_metadata(pathlib.Path(self._get_metadata_path(rank)))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class TensorOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, refusing the pickled non-tensor items gradsync never writes."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        raise UnsafeCheckpointError(
            f"the checkpoint stores '{read_item.dest_index.fqn}' as a pickled object; gradsync writes "
            "tensors only and refuses to unpickle it (it could run code)."
        )


@contextlib.contextmanager
def coordination(group: Any) -> Iterator[dict[str, Any]]:
    """DCP's arguments for who takes part in a save or load made inside: `group`, or nobody else
    when there is no process group (one process alone).

    Alone, DCP warns on every save and load that it assumes a single process, even when told so
    (`no_dist=True`); that is the intent here, so the warning is left out.
    """
    if dist.is_available() and dist.is_initialized():
        yield {"process_group": group}
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield {"no_dist": True} if "no_dist" in inspect.signature(dcp.save).parameters else {}


def load(contents: dict[str, Any], path: pathlib.Path, group: Any = None) -> None:
    """DCP's load of `contents` (in place) from `path`, with the safe reader and planner.

    DCP wraps every rank's error in one CheckpointException; the first rank's is raised as
    the gradsync error it was, or as one that names the folder.
    """
    try:
        with coordination(group) as participants:
            dcp.load(contents, storage_reader=SafeFileSystemReader(path), planner=TensorOnlyLoadPlanner(), **participants)
    except CheckpointException as wrapped:
        first = next(iter(wrapped.failures.values()), wrapped)
        if isinstance(first, tuple):  # DCP keeps (exception, traceback frames)
            first = first[0]
        if isinstance(first, GradsyncError):
            raise first from wrapped
        raise GradsyncError(f"{path} could not be loaded: {type(first).__name__}: {first}") from wrapped
