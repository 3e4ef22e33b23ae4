"""What the script check's watches share (gradsync.run.script_facts, the checks of gradsync.doctor.script):
fingerprints and hashes of tensors, compared across ranks, an optimizer's settings as one text,
the sampler a DataLoader draws indices from, and replacing functions and methods in place (and back).
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from gradsync.run.harmless import IdentityMap

FINGERPRINT_SAMPLES = 256  # values sampled (evenly strided) from each tensor
_NESTING_DEPTH = 3  # how deep lists, tuples and dicts of inputs are searched for tensors


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().reshape(-1).contiguous().cpu()
    return memoryview(flat.view(torch.uint8).numpy())


def _header(tensor: torch.Tensor) -> int:
    return zlib.crc32(f"{tensor.dtype}{tuple(tensor.shape)}".encode())


def tensor_fingerprint(tensor: torch.Tensor) -> int | None:
    """A CRC of dtype, shape and an evenly strided sample of the values (None when unreadable).

    Cheap enough for every forward of the first steps (a few hundred values copied to the CPU);
    two different batches agree on it only by an unlikely coincidence.
    """
    try:
        flat = tensor.detach().reshape(-1)
        stride = max(1, flat.numel() // FINGERPRINT_SAMPLES)
        return zlib.crc32(_raw_bytes(flat[::stride][:FINGERPRINT_SAMPLES]), _header(tensor))
    except (RuntimeError, TypeError):  # sparse, quantized or meta tensors: not comparable
        return None


def tensor_hash(tensor: torch.Tensor) -> int | None:
    """A CRC of dtype, shape and every byte of the values (None when unreadable)."""
    try:
        return zlib.crc32(_raw_bytes(tensor), _header(tensor))
    except (RuntimeError, TypeError):
        return None


def nested_tensors(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """The tensors in a value and in its lists, tuples and dicts, a few levels deep."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < _NESTING_DEPTH and isinstance(value, (list, tuple)):
        for item in value:
            yield from nested_tensors(item, depth + 1)
    elif depth < _NESTING_DEPTH and isinstance(value, Mapping):
        for item in value.values():
            yield from nested_tensors(item, depth + 1)


def tensors_fingerprint(tensors: Iterable[torch.Tensor]) -> int | None:
    """One fingerprint of many tensors, in order; None when there is none or one is unreadable."""
    combined = 0
    found = False
    for tensor in tensors:
        fingerprint = tensor_fingerprint(tensor)
        if fingerprint is None:
            return None
        combined = zlib.crc32(fingerprint.to_bytes(4, "little"), combined)
        found = True
    return combined if found else None


def inputs_fingerprint(args: tuple, kwargs: dict) -> int | None:
    """One fingerprint of every tensor among a forward's arguments; None when there is none."""
    return tensors_fingerprint(nested_tensors((args, kwargs)))


def hyperparameters(optimizer: Any) -> str:
    """The optimizer's per-group settings (learning rate, momentum, ...) as one comparable text."""
    groups = []
    for group in optimizer.param_groups[:8]:
        items = []
        for key, value in sorted(group.items()):
            if key == "params":
                continue
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = float(value.detach().cpu())
            if isinstance(value, (bool, int, float, str, type(None))) or (
                isinstance(value, tuple) and all(isinstance(v, (int, float)) for v in value)
            ):
                items.append(f"{key}={value!r}")
        groups.append("; ".join(items))
    return " | ".join(groups)


def dtensor_class() -> type | None:
    """torch's DTensor (FSDP2's and tensor parallelism's sharded tensors); None on a torch without it.
    A watch leaves them alone: their shards differ across ranks by design, and reading one whole
    is a collective."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor


def index_sampler(loader: Any) -> Any:
    """The sampler whose indices a DataLoader batches (None for a plain list of batches)."""
    if loader.batch_sampler is None:  # batch_size=None: one sample at a time
        return loader.sampler
    return getattr(loader.batch_sampler, "sampler", None)


class Patches:
    """What an install replaced, to put back in reverse order (`undo`): the worker never does, but
    the tests install the script check inside pytest's own process and must leave torch as it was."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
        """Replace `owner.name` with `make(original)`, keeping the original's name and docstring."""
        original = getattr(owner, name)
        self.replace(owner, name, functools.wraps(original)(make(original)))

    def replace(self, owner: Any, name: str, replacement: Any) -> None:
        """Set `owner.name`; undone by restoring what `owner` itself held (or by deleting what it
        only inherited, so that a subclass falls back to its base class again)."""
        held = vars(owner)
        if name in held:
            original = held[name]
            self._undo.append(lambda: setattr(owner, name, original))
        else:
            self._undo.append(lambda: delattr(owner, name))
        setattr(owner, name, replacement)

    def on_undo(self, undo: Callable[[], None]) -> None:
        """Run `undo` (a hook handle's remove) with the rest."""
        self._undo.append(undo)

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()


def group_ranks(group: Any) -> list[int] | None:
    """The global ranks of a process group; None when torch cannot say (then every rank is assumed)."""
    try:
        import torch.distributed as dist

        return list(dist.get_process_group_ranks(group))
    except Exception:  # a group torch no longer knows: compared as before, across every rank
        return None


class ModuleForwards:
    """Forward pre-hooks on the script's modules, kept beside them (harmless.IdentityMap): one
    hook common to all modules (torch's `register_module_forward_pre_hook`, installed with the
    first module watched) calls those of the modules watched. A hook registered on the module
    itself would sit in its `_forward_pre_hooks`, and travel into every deepcopy of the user's
    model (still recording for gradsync) and every pickle of it (which fails on the closure).
    The hooks see the positional arguments only (torch's common hooks get no keywords), and stop
    once the script compiles (`stop`)."""

    def __init__(self) -> None:
        self._hooks = IdentityMap()  # module -> its hooks, each called with (module, args)
        self._handle: Any = None
        self._stopped = False

    def watch(self, module: torch.nn.Module, hook: Callable[[Any, tuple], None]) -> None:
        if self._stopped:
            return
        hooks = self._hooks.get(module)
        if hooks is None:
            hooks = []
            self._hooks[module] = hooks
        hooks.append(hook)
        if self._handle is None:
            from torch.nn.modules.module import register_module_forward_pre_hook

            self._handle = register_module_forward_pre_hook(self._called)

    def _called(self, module: Any, args: tuple) -> None:
        # Inside every module's call: returning None leaves its inputs alone.
        for hook in self._hooks.get(module) or ():
            hook(module, args)

    def stop(self) -> None:
        """No more hooks: the script compiles (torch.compile warns of every hook common to all
        modules, on each call of a compiled module, and calls it again around it)."""
        self._stopped = True
        self.remove()

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
