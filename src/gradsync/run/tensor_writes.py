"""Every write to the training state, whatever path made it, with the user's line: read at the tensor level.

A mistake that splits the ranks' state is one write: `p.mul_(0.5)` under `if rank == 0:`, an
`nn.init` call on a wrapped layer, `p.data = ...`, `p.grad.div_(local_count)`, `requires_grad_`
on a layer some ranks freeze, `zero_grad()` some ranks skip. An enumeration of entry points
(`load_state_dict`, a scheduler's step) cannot reach the paths nobody listed, so the writes are
read where every path goes through: torch's Python dispatch of its functions and methods
(`__torch_function__`, one `TorchFunctionMode` pushed before the script runs). Every call is
classified once by what it is (an in-place method or function, `__setitem__`, `out=`, a setter
of `.data`, `.grad` or `.requires_grad`); a write is then matched against the training state (the
parameters, their gradients and the buffers of the models the script wrapped, and the parameters
its optimizers step) and the state of the modules run beside them (gradsync.run.companions) by
the memory it touches, so a write through an alias (`p.data.mul_`, a view) is the parameter's.
Each match is offered to the host's listeners as a `StateWrite`, with the user's file:line, the
line of the training loop it was made under, and the plain numbers the call was given. The same
mode sees reads: a tensor whose first read is awaited (a collective's result, `ResultReads`) is
read when a call is given it, and was never read if it dies first; and a tensor followed
(`Derivations`) is followed into the results of the calls given it, so that what a loss was
computed from can be told at its backward.

Not seen: the optimizer's own step and writes made inside it (the update itself), what C++ does
on its own (autograd accumulating gradients, DDP's reducer and buffer broadcast, a collective
writing its output), and anything once the script calls `torch.compile` (dynamo traces torch
function modes: the mode is taken off there, as the module hooks are). Cost, under
`--doctor-steps` only: a Python call per torch function call of the script's thread (a few
microseconds), and a look at the memory of each in-place call.

"""

from __future__ import annotations

import bisect
import dataclasses
import math
import sys
import types
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from gradsync.callsite import caller_location, location
from gradsync.run.check_primitives import Patches, dtensor_class, tensors_fingerprint
from gradsync.run.harmless import Bookkeeping, IdentityMap

# What a call does to its first argument (or to `out=`), by kind.
WRITE = "write"  # changes the values in place
SET_DATA, SET_GRAD, SET_REQUIRES_GRAD = "data =", "grad =", "requires_grad ="
REQUIRES_GRAD = "requires_grad_"
_NOT_VALUE_WRITES = frozenset({"share_memory_", "retain_grad", "pin_memory_", "is_set_to", "record_stream_"})
_SETTERS = {"data": SET_DATA, "grad": SET_GRAD, "requires_grad": SET_REQUIRES_GRAD}
SCALARS_KEPT = 4  # plain numbers kept per write
COMPANION = "companion"  # the kind of a companion module's tensor in the index (gradsync.run.companions)


@dataclass(frozen=True)
class StateWrite:
    """One call that wrote to the training state, as the host offers it."""

    op: str  # "mul_", "copy_", "__setitem__", "grad =", "data =", "requires_grad =", "uniform_" (nn.init) ...
    kinds: tuple[str, ...]  # which parts it touched: "parameter", "gradient", "buffer", "companion"
    names: tuple[str, ...]  # the tensors' names in their model (a few), "?" for a parameter outside every model
    site: str | None  # the user's file:line that made it
    scalars: tuple[str, ...]  # the plain numbers it was given (a one-element tensor's value), as text
    forwarding: bool  # made inside a forward of a wrapped model (a buffer updated in forward)
    sharded: bool = False  # it wrote a sharded tensor (a DTensor: FSDP2, tensor parallelism), which ranks hold apart
    # The line of the training loop (the function that steps the optimizer) the write was made
    # under: `update(teacher)` there when the write itself is inside update(). None before the first step.
    loop_site: str | None = None
    # A fingerprint of what a write to a companion module's state left (gradsync.run.companions):
    # every rank makes the same update of an input normalizer, each from its own batch.
    result: int | None = None


def _classify(func: Any) -> str | None:
    name = getattr(func, "__name__", "")
    if isinstance(func, types.MethodWrapperType):
        if name == "__set__":
            return _SETTERS.get(getattr(func.__self__, "__name__", ""))
        return None
    if name == "requires_grad_":
        return REQUIRES_GRAD
    if name == "__setitem__" or (name.endswith("_") and not name.endswith("__") and name not in _NOT_VALUE_WRITES):
        return WRITE
    return None


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, torch.Tensor):
                yield item


def _scalar_text(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_meta or type(value) is not torch.Tensor:
            return None  # a DTensor's value is a collective away
        value = value.item()
    return repr(value) if not (isinstance(value, float) and math.isnan(value)) else "nan"


class StateIndex:
    """The training state's tensors, found by identity (a setter names the tensor itself) and by
    the memory they hold (an in-place write may come through an alias: `.data`, a view, a
    DTensor's `to_local()` shard)."""

    def __init__(self) -> None:
        self._by_identity = IdentityMap()  # tensor -> (kind, name, sharded)
        self._starts: list[int] = []
        self._spans: list[tuple[int, int, str, str, bool]] = []  # (start, end, kind, name, sharded), sorted
        self._dtensor = dtensor_class()

    def rebuild(self, named: Iterable[tuple[str, str, torch.Tensor]]) -> None:
        """From (kind, name, tensor) triples: parameters, gradients, buffers."""
        identity, spans = IdentityMap(), []
        for kind, name, tensor in named:
            sharded = self._dtensor is not None and isinstance(tensor, self._dtensor)
            identity[tensor] = (kind, name, sharded)
            memory = tensor.to_local() if sharded else tensor  # a shard's memory is the rank's own
            try:
                start = memory.data_ptr()
            except RuntimeError:  # a subclass without storage of its own: found by identity only
                continue
            if start:
                spans.append((start, start + memory.numel() * memory.element_size(), kind, name, sharded))
        spans.sort()
        self._by_identity, self._spans, self._starts = identity, spans, [span[0] for span in spans]

    def of(self, tensor: torch.Tensor) -> list[tuple[str, str, bool]]:
        """The state tensors `tensor` is, or holds memory of: (kind, name, whether it is sharded)."""
        found = self._by_identity.get(tensor)
        if found is not None:
            return [found]
        try:
            start = tensor.data_ptr()
            end = start + tensor.numel() * tensor.element_size()
        except RuntimeError:
            return []
        if not start or start == end:
            return []
        hits = []
        index = bisect.bisect_right(self._starts, start) - 1
        for span_start, span_end, kind, name, sharded in self._spans[max(index, 0):]:
            if span_start >= end:
                break
            if span_end > start:
                hits.append((kind, name, sharded))
        return hits


class ResultReads:
    """Results whose first read is awaited (a collective's output, or its output list as one), found
    among every call's arguments.

    A result whose tensors all die before any torch function was given one of them was never read:
    `unread` is called. (One read tensor of a gathered list is a read of the list: a script may
    drop its own slot for the local tensor that keeps its gradient.) Only a tensor that is the sole
    owner of its memory is watched (not a view, no other tensor on its storage: `p.grad.data` is
    read through `p.grad`), so reading it means naming it."""

    def __init__(self) -> None:
        self._awaited: dict[int, tuple[weakref.ref, _Result]] = {}

    def __bool__(self) -> bool:
        return bool(self._awaited)

    def await_read(self, tensors: list[torch.Tensor], unread: Callable[[], None]) -> bool:
        """Watch the first read of the result held in `tensors`; False where it cannot be told (a
        view, shared memory)."""
        if not tensors or not all(_sole_owner(t) for t in tensors):
            return False
        result = _Result(unread, {id(t) for t in tensors})
        awaited = self._awaited

        for tensor in tensors:
            def died(_: Any, ident: int = id(tensor)) -> None:
                if awaited.pop(ident, None) is not None:
                    result.left.discard(ident)
                    if not result.left:
                        result.unread()

            awaited[id(tensor)] = (weakref.ref(tensor, died), result)
        return True

    def clear(self) -> None:
        """Reads no longer seen (the mode is off): nothing awaited can be said unread."""
        self._awaited.clear()

    def seen(self, args: tuple, kwargs: dict) -> None:
        for value in (*args, *kwargs.values()):
            for tensor in _tensors(value):
                entry = self._awaited.get(id(tensor))
                if entry is not None and entry[0]() is tensor:
                    for ident in entry[1].left:  # the whole result is read
                        self._awaited.pop(ident, None)


class Derivations:
    """Tensors followed through what is computed from them: the result of a torch call given a
    followed tensor (or a list holding one) is followed too, with the same origin. What a loss was
    computed from can then be told when it reaches backward (a gathered copy of a rank's own
    features, which no gradient flows through). Bounded: past FOLLOWED_AT_MOST tensors alive, the
    newest are not followed."""

    FOLLOWED_AT_MOST = 4096

    def __init__(self) -> None:
        self._followed: dict[int, tuple[weakref.ref, object]] = {}

    def __bool__(self) -> bool:
        return bool(self._followed)

    def follow(self, tensor: torch.Tensor, origin: object) -> None:
        if len(self._followed) >= self.FOLLOWED_AT_MOST:
            return
        followed, ident = self._followed, id(tensor)
        self._followed[ident] = (weakref.ref(tensor, lambda _, ident=ident: followed.pop(ident, None)), origin)

    def origin(self, tensor: Any) -> object | None:
        """The origin `tensor` was computed from, None where it was computed from none followed."""
        entry = self._followed.get(id(tensor))
        return entry[1] if entry is not None and entry[0]() is tensor else None

    def derive(self, args: tuple, kwargs: dict, result: Any) -> None:
        origin = next((found for value in (*args, *kwargs.values()) for tensor in _tensors(value)
                       if (found := self.origin(tensor)) is not None), None)
        if origin is not None:
            for tensor in _tensors(result):
                if self.origin(tensor) is None:
                    self.follow(tensor, origin)

    def clear(self) -> None:
        self._followed.clear()


@dataclass
class _Result:
    unread: Callable[[], None]
    left: set[int]  # ids of its tensors still alive and awaited


def _use_count(tensor: torch.Tensor) -> int | None:
    count = getattr(torch._C, "_storage_Use_Count", None)
    try:
        return count(tensor.untyped_storage()._cdata) if count is not None else None
    except (RuntimeError, AttributeError, TypeError):  # no storage of its own (a subclass, a meta tensor)
        return None


_SOLE = _use_count(torch.empty(1))  # a storage's count of owners with one tensor on it (its Python wrapper counts too)


def _sole_owner(tensor: torch.Tensor) -> bool:
    if type(tensor) is not torch.Tensor or tensor._base is not None or _SOLE is None:
        return False
    return _use_count(tensor) == _SOLE


class StateWriteMode(TorchFunctionMode):
    """The mode on the script's thread: passes every call on as it came, and tells `heard` of each
    one that wrote to the state `index` holds. `stepping()` says when an optimizer step is under
    way (its writes are the update itself); `forwarding()` when a wrapped model's forward is."""

    def __init__(self, index: StateIndex, heard: Callable[[StateWrite], None], bookkeeping: Bookkeeping,
                 stepping: Callable[[], bool], forwarding: Callable[[], bool], loop: Callable[[], Any]) -> None:
        super().__init__()
        self.index = index
        self.heard = heard
        self.bookkeeping = bookkeeping
        self.stepping = stepping
        self.forwarding = forwarding
        self.loop = loop  # the code object of the function that steps the optimizer (None before the first step)
        self.reads = ResultReads()
        self.derivations = Derivations()
        self._kinds: dict[Any, str | None] = {}

    def __torch_function__(self, func: Any, types_: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.reads:
            with self.bookkeeping:
                self.reads.seen(args, kwargs)
        kind = None
        with self.bookkeeping:
            kind = self._kind_of(func, kwargs)
        if kind is None:
            result = func(*args, **kwargs)
        else:
            write, targets = None, []
            with self.bookkeeping:
                if not self.stepping():
                    write, targets = self._write(func, kind, args, kwargs)
            result = func(*args, **kwargs)
            if write is not None:
                with self.bookkeeping:
                    if COMPANION in write.kinds:
                        write = dataclasses.replace(write, result=tensors_fingerprint(targets))
                    self.heard(write)
        if self.derivations:
            with self.bookkeeping:
                self.derivations.derive(args, kwargs, result)
        return result

    def _kind_of(self, func: Any, kwargs: dict) -> str | None:
        if isinstance(func, types.MethodWrapperType):  # a setter: a new wrapper object on every access
            return _classify(func)
        try:
            kind = self._kinds[func]
        except KeyError:
            kind = self._kinds[func] = _classify(func)
        except TypeError:  # an unhashable callable
            kind = _classify(func)
        if kind is None and kwargs.get("out") is not None:
            return WRITE
        return kind

    def _write(self, func: Any, kind: str, args: tuple, kwargs: dict) -> tuple[StateWrite | None, list[torch.Tensor]]:
        named = dict(kwargs)
        if kind == WRITE and named.get("out") is not None:
            targets, rest = list(_tensors(named.pop("out"))), args
        elif args:
            targets, rest = list(_tensors(args[0])), args[1:]
        else:  # all by keyword, as torch passes nn.init's arguments on: the tensor first
            first = next((key for key in named if key in ("tensor", "input", "self", "tensors")), None)
            targets, rest = list(_tensors(named.pop(first))) if first else [], ()
        hits = [hit for target in targets for hit in self.index.of(target)]
        if not hits:
            return None, []
        if kind == SET_GRAD:  # `p.grad = ...` replaces the parameter's gradient (a companion's gradients are not its state)
            hits = [("gradient", name, sharded) for hit_kind, name, sharded in hits if hit_kind != COMPANION]
            if not hits:
                return None, []
        if kind in (SET_REQUIRES_GRAD, REQUIRES_GRAD):
            flag = rest[0] if rest else named.get("requires_grad", True)
            scalars = (repr(bool(flag)),)
        else:
            scalars = tuple(text for text in (_scalar_text(value) for value in (*rest, *named.values()))
                            if text is not None)[:SCALARS_KEPT]
        op = kind if kind != WRITE else getattr(func, "__name__", "?")
        kinds = tuple(sorted({hit[0] for hit in hits}))
        names = tuple(dict.fromkeys(hit[1] for hit in hits))[:4]
        sharded = any(hit[2] for hit in hits)
        return StateWrite(op, kinds, names, caller_location(), scalars, self.forwarding(), sharded, self._loop_site()), targets

    def _loop_site(self) -> str | None:
        loop = self.loop()
        frame = sys._getframe(2)
        while loop is not None and frame is not None:
            if frame.f_code is loop:
                return location(frame)
            frame = frame.f_back
        return None


class TensorWrites:
    """The state index and the mode, installed for the host."""

    def __init__(self, heard: Callable[[StateWrite], None], bookkeeping: Bookkeeping,
                 stepping: Callable[[], bool], forwarding: Callable[[], bool], loop: Callable[[], Any]) -> None:
        self.index = StateIndex()
        self.mode = StateWriteMode(self.index, heard, bookkeeping, stepping, forwarding, loop)
        self._on = False

    def install(self, patches: Patches) -> None:
        self.mode.__enter__()
        self._on = True
        patches.on_undo(self.stop)

    def await_read(self, tensors: list[torch.Tensor], unread: Callable[[], None]) -> bool:
        """Call `unread` if the result in `tensors` dies before the script reads it (ResultReads); False where that
        cannot be told."""
        return self._on and self.mode.reads.await_read(tensors, unread)

    def follow(self, tensor: torch.Tensor, origin: object) -> None:
        """Follow `tensor` through what the script computes from it (Derivations), as from `origin`."""
        if self._on:
            self.mode.derivations.follow(tensor, origin)

    def origin(self, tensor: Any) -> object | None:
        """The origin of a followed tensor `tensor` was computed from (None: none)."""
        return self.mode.derivations.origin(tensor) if self.mode.derivations else None

    def read_elsewhere(self, args: tuple, kwargs: dict) -> None:
        """Tensors handed to a call the mode does not see (a collective): read."""
        if self.mode.reads:
            self.mode.reads.seen(args, kwargs)

    def stop(self) -> None:
        """Off for good: the script compiles (dynamo traces the modes on the stack), or the run ends."""
        if not self._on:
            return
        self._on = False
        self.mode.reads.clear()
        self.mode.derivations.clear()
        stack = torch.overrides._get_current_function_mode_stack()
        if stack and stack[-1] is self.mode:
            self.mode.__exit__(None, None, None)
        else:  # another mode above it, the script's: leave the stack as it is, and stop listening
            self.mode.heard = lambda write: None
