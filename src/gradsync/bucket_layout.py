"""DDP's gradient-bucket layout across a resume: the same layout before and after a restart.

DDP starts a model with one provisional bucket layout and, after the first backward that
reduces gradients, rebuilds its buckets once, grouping parameters in the order their gradients
became ready (rank 0's order, broadcast to every rank). A process that resumes from a
checkpoint starts again in the provisional layout, so its first step reduces other bucket
tensors than the uninterrupted run did at that step. With three or more ranks the ring
all-reduce then adds each element's contributions in another order and the last bits differ;
two ranks are spared only because a + b = b + a.

The layout is a function of one thing: the gradient-ready order of the run's first synced
backward. So gradsync records that order (`ReadyOrder`, parameter names, per rank), saves it
with each checkpoint, and on resume replays it (`replay`): a backward through a chain of
stand-in nodes that gives each parameter a zero gradient in the recorded order. DDP's own hooks
see the order they would have seen, and DDP rebuilds its buckets exactly as the uninterrupted
run did, before the first real step. While it runs, gradsync's communication hook hands every
bucket back untouched, so nothing is communicated and no compression state (PowerSGD memories,
error-feedback residuals) advances; the model's gradients are put back as they were after it.

Under `static_graph=True` DDP learns the graph in its first synced backward and rebuilds after
the second, so the replay runs as many of those as the recorded run had (two at most).
`find_unused_parameters=True` without static_graph needs nothing: DDP never rebuilds then.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradsync import compat


def rebuilds_buckets(find_unused_parameters: bool, static_graph: bool) -> bool:
    """Whether DDP changes its bucket layout after the first synced backward(s), as `replay`
    reproduces. Only `find_unused_parameters=True` without `static_graph` keeps the first
    layout for good."""
    return static_graph or not find_unused_parameters


class ReadyOrder:
    """The order in which this rank's parameters got their gradients in the run's first synced
    backward (the input DDP builds its lasting bucket layout from), and how many synced
    backwards ran since (DDP's layout changes after the first, or under `static_graph`, which
    learns the graph in its first, after the second).

    It is recorded once per lineage of runs: a resumed run gets it from the checkpoint and
    passes it on to its own checkpoints.
    """

    def __init__(self, module: nn.Module) -> None:
        self._module = module
        self.names: list[str] | None = None
        self.synced_backwards = 0  # counted up to 2: all the layout depends on

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        """Around each backward that DDP reduces. The first time, note each parameter as its
        gradient is accumulated."""
        if self.names is not None:
            self.synced_backwards = min(self.synced_backwards + 1, 2)
            yield
            return
        with _noting_ready(self._module) as seen:
            yield
        if seen:
            self.names, self.synced_backwards = seen, 1

    def state_dict(self) -> dict[str, Any]:
        return {"names": self.names, "synced_backwards": self.synced_backwards}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.names, self.synced_backwards = state["names"], state["synced_backwards"]


@contextlib.contextmanager
def _noting_ready(module: nn.Module) -> Iterator[list[str]]:
    """Inside, the names of `module`'s parameters are listed as their gradients are accumulated:
    the moment DDP's own hook on each runs, so in the order DDP sees."""
    seen: list[str] = []
    handles = [
        parameter.register_post_accumulate_grad_hook(lambda _, name=name: seen.append(name))
        for name, parameter in module.named_parameters()
        if parameter.requires_grad
    ]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def replay_problem(ddp_model: DistributedDataParallel, names: list[str]) -> str | None:
    """Why a recorded order cannot be replayed on this model and this torch (None: it can)."""
    lacking = [api.where for api in compat.BUCKET_LAYOUT if not api.available()]
    if lacking:
        return f"torch {torch.__version__} has no {', '.join(lacking)}"
    if getattr(ddp_model, "static_graph", False) and not hasattr(ddp_model, "_static_graph_delay_allreduce_enqueued"):
        return f"torch {torch.__version__}'s DDP does not show whether static_graph's first reduction was queued"
    trainable = {name for name, p in ddp_model.module.named_parameters() if p.requires_grad}
    if set(names) != trainable:
        return "the checkpoint's gradient-ready order names other parameters than this model trains"
    return None


class _ZeroGradientAfter(torch.autograd.Function):
    """Passes `carry` through; in backward, gives `parameter` a zero gradient, then the chain
    goes on to the node built before this one."""

    @staticmethod
    def forward(ctx: Any, carry: torch.Tensor, parameter: torch.Tensor) -> torch.Tensor:
        ctx.like = (parameter.shape, parameter.dtype, parameter.device)
        return carry.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape, dtype, device = ctx.like
        return grad, torch.zeros(shape, dtype=dtype, device=device)


def _zero_gradients_in_order(parameters: dict[str, nn.Parameter], names: list[str]) -> torch.Tensor:
    """A scalar whose backward accumulates a zero gradient into each named parameter, in order.

    The last node built runs first in backward, and the engine runs a parameter's gradient
    accumulation (and DDP's hook on it) as soon as its input is ready: so the chain is built in
    reverse.
    """
    first = parameters[names[0]]
    carry = torch.zeros((), dtype=first.dtype, device=first.device, requires_grad=True)
    for name in reversed(names):
        carry = _ZeroGradientAfter.apply(carry, parameters[name])
    return carry


def replay(ddp_model: DistributedDataParallel, order: ReadyOrder, silence: Callable[[], AbstractContextManager[Any]]) -> bool:
    """Bring `ddp_model` to the bucket layout (and, under static_graph, the learned graph) that
    `order` led to in the recorded run, before its first step. Collective: every rank calls it
    (DDP broadcasts rank 0's layout).

    `silence()` must make the model's communication hook return each bucket unreduced. True when
    DDP's hooks fired in the recorded order (so the layout is the recorded run's).
    """
    assert order.names is not None
    reducer = ddp_model.reducer
    parameters = dict(ddp_model.module.named_parameters())
    kept_grads = {name: p.grad for name, p in parameters.items()}
    static = bool(getattr(ddp_model, "static_graph", False))
    backwards = min(order.synced_backwards, 2) if static else 1
    with _noting_ready(ddp_model.module) as fired:
        for backward in range(backwards):
            # What DDP's forward does before a synced backward.
            reducer.prepare_for_forward()
            reducer.prepare_for_backward([])
            carry = _zero_gradients_in_order(parameters, order.names)
            if static and backward == 0:
                # static_graph's first backward only counts each parameter's hooks; DDP's forward
                # output queues the reduction of every bucket at its end (_DDPSink), and notes it.
                carry.register_hook(lambda grad: _queue_at_end_of_backward(reducer._delay_all_reduce, grad))
                ddp_model._static_graph_delay_allreduce_enqueued = True
            with silence():
                carry.backward()
    if not static or backwards == 2:
        reducer._rebuild_buckets()
    for name, p in parameters.items():
        p.grad = kept_grads[name]
    return fired == order.names * backwards


def _queue_at_end_of_backward(callback: Any, grad: torch.Tensor) -> torch.Tensor:
    torch.autograd.Variable._execution_engine.queue_callback(callback)  # type: ignore[attr-defined]
    return grad
