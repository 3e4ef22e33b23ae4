"""The modules a training step runs beside the models it trains: an EMA teacher, a target network,
an input normalizer, a loss that holds class weights.

Data parallelism keeps one copy of the wrapped model on every rank: DDP broadcasts it once and
averages its gradients, fully_shard splits it by design. A module the step runs beside it gets
neither. It stays one state on every rank only if every rank builds it alike and updates it alike,
and nothing fails when one does not: each rank trains toward its own teacher, normalises with its
own statistics, and rank 0's checkpoint holds rank 0's copy.

Which modules those are is read from the calls themselves, not from a list of patterns: a pair of
hooks common to all modules (torch's `register_module_forward_pre_hook` and
`register_module_forward_hook`, so nothing sits on the user's modules) notes each module called
once a model is wrapped or sharded, outside the call of any other module that is not wrapped (a
teacher's layers are the teacher's). Its state is what it holds beside the wrapped models and
the parameters an optimizer steps (those are the training state's own, compared as such), and
beside sharded tensors (DTensors, apart by design). The hooks stop when the script compiles, as
every hook common to all modules does.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradsync.callsite import caller_location
from gradsync.run.check_primitives import dtensor_class
from gradsync.run.harmless import Bookkeeping

MAX_COMPANIONS = 32  # live companions kept per rank: a loss module built anew each step is one, replaced


@dataclass(frozen=True)
class CompanionState:
    """One companion's tensors at a moment, outside the wrapped and stepped ones."""

    key: str  # "Class called at file:line": how the ranks pair their companions
    parameters: list[tuple[str, torch.Tensor]]
    buffers: list[tuple[str, torch.Tensor]]


class CompanionModules:
    """The companions of one rank, in the order first called (weakly held: a dead one is dropped)."""

    def __init__(self, training: Callable[[], bool], wrapped_modules: Callable[[], set[int]],
                 training_state: Callable[[], set[int]], bookkeeping: Bookkeeping, discovered: Callable[[], None]) -> None:
        self._training = training  # whether a model is wrapped or sharded yet
        self._wrapped_modules = wrapped_modules  # ids of the DDP objects, their modules and the sharded units' modules
        self._training_state = training_state  # ids of the wrapped models' tensors and of the stepped parameters
        self._bookkeeping = bookkeeping
        self._discovered = discovered  # told after a companion is first called
        self._found: list[tuple[weakref.ref, str]] = []  # (module, key), in the order first called
        self._calls: list[tuple[Any, bool]] = []  # the module calls in progress: (module, whether it is a companion's)
        self._inside = 0  # companion calls in progress (their inner modules are theirs)
        self._handles: list[Any] = []

    def install(self) -> None:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        self._handles = [register_module_forward_pre_hook(self._called), register_module_forward_hook(self._returned)]

    def stop(self) -> None:
        """No more hooks: the script compiles, or the run ends."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def between_steps(self) -> None:
        """No module call is in progress at an optimizer step: a forward that raised (no return
        hook ran for it) is forgotten here."""
        self._calls.clear()
        self._inside = 0

    def _called(self, module: Any, args: tuple) -> None:
        # Inside every module's call: returning None leaves its inputs alone.
        counted = False
        with self._bookkeeping:
            counted = self._inside == 0 and self._training() and id(module) not in self._wrapped_modules()
            if counted:
                self._note(module)
        self._calls.append((module, counted))
        if counted:
            self._inside += 1

    def _returned(self, module: Any, args: tuple, output: Any) -> None:
        while self._calls:
            called, counted = self._calls.pop()
            if counted:
                self._inside -= 1
            if called is module:
                break

    def _note(self, module: Any) -> None:
        if any(ref() is module for ref, _ in self._found):
            return
        if next(module.parameters(), None) is None and next(module.buffers(), None) is None:
            return  # nothing to hold apart (an activation, a dropout built inside a forward)
        key = f"{type(module).__qualname__} called at {caller_location() or '?'}"
        alive = [(ref, k) for ref, k in self._found if ref() is not None and k != key]  # one built anew replaces the last
        self._found = [*alive, (weakref.ref(module), key)][-MAX_COMPANIONS:]
        self._discovered()

    def states(self, training_state: set[int] | None = None) -> list[CompanionState]:
        """Each live companion's parameters and buffers, leaving out the training state's own (the
        wrapped models' tensors, the stepped parameters: their ids, when the caller has them at
        hand) and sharded ones; a companion with nothing left is none."""
        if not self._found:
            return []
        dtensor = dtensor_class()
        excluded = training_state if training_state is not None else self._training_state()

        def own(named: Any) -> list[tuple[str, torch.Tensor]]:
            return [(name, t) for name, t in named if id(t) not in excluded and not (dtensor is not None and isinstance(t, dtensor))]

        found = []
        for ref, key in self._found:
            module = ref()
            if not isinstance(module, nn.Module):
                continue
            parameters, buffers = own(module.named_parameters()), own(module.named_buffers())
            if parameters or buffers:
                found.append(CompanionState(key, parameters, buffers))
        return found
