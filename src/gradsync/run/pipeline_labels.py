"""What a pipeline's point-to-point messages carry: which stage, which micro-batch, activations
or gradients, to or from which stage.

`torch.distributed.pipelining` sends each micro-batch's activations forward (and, in backward,
their gradients back) with isend/irecv between neighbouring stages. The recorder sees each send
and receive, its tensor and its peer, but not what it is for; a hang between stages reads far
better as "stage 1 waits for micro-batch 2's activations from stage 0". A stage builds each
message's operations in `get_fwd_recv_ops(i)` and its three kin, so those are wrapped to label
the operations' tensors, and the recorder reads the label when the operation is issued.

The wrapping happens when the user's script imports the stage module, not before: importing
it costs about a second, which scripts without pipelines must not pay. Labels are kept by
tensor identity, checked through a weak reference, so a recycled id never lends a stale label
to an unrelated tensor. Nothing here may raise into the script: a label that cannot be made
is left out.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import weakref
from typing import Any, Callable

STAGE_MODULE = "torch.distributed.pipelining.stage"
_PRUNE_AT = 4096  # labels kept before dead ones are dropped


class PipelineLabels:
    """Tensor -> what it carries between stages (set when the stage builds its operations)."""

    def __init__(self) -> None:
        self._labels: dict[int, tuple[weakref.ref, str]] = {}

    def label(self, tensor: Any, text: str) -> None:
        try:
            self._labels[id(tensor)] = (weakref.ref(tensor), text)
        except TypeError:  # not weak-referenceable: go without
            return
        if len(self._labels) > _PRUNE_AT:
            self._labels = {key: entry for key, entry in self._labels.items() if entry[0]() is not None}

    def of(self, tensor: Any) -> str:
        """The label of `tensor`, or "" when no stage made one for it."""
        entry = self._labels.get(id(tensor))
        return entry[1] if entry is not None and entry[0]() is tensor else ""


# (method, what travels, direction, the peer stage's offset)
_MESSAGES = (
    ("get_fwd_recv_ops", "activations", "from", -1),
    ("get_fwd_send_ops", "activations", "to", +1),
    ("get_bwd_recv_ops", "gradients", "from", +1),
    ("get_bwd_send_ops", "gradients", "to", -1),
)


def _labelled(labels: PipelineLabels, original: Callable, carries: str, direction: str, offset: int) -> Callable:
    def build_ops(stage: Any, chunk: int, *args: Any, **kwargs: Any) -> Any:
        ops = original(stage, chunk, *args, **kwargs)
        try:
            text = (f"pipeline stage {stage.stage_index} of {stage.num_stages}: micro-batch {chunk}'s {carries} "
                    f"{direction} stage {stage.stage_index + offset}")
            for op in ops:
                labels.label(op.tensor, text)
        except Exception:  # a label is never worth failing the script's step
            pass
        return ops

    build_ops.__gradsync_original__ = original  # type: ignore[attr-defined]
    return build_ops


def _wrap_stage_class(labels: PipelineLabels, module: Any, undo: list[tuple[Any, str, Any]]) -> None:
    base = getattr(module, "_PipelineStageBase", None)
    if base is None:
        return
    for method, carries, direction, offset in _MESSAGES:
        original = base.__dict__.get(method)
        if original is None or hasattr(original, "__gradsync_original__"):
            continue
        undo.append((base, method, original))
        setattr(base, method, _labelled(labels, original, carries, direction, offset))


class _WrapOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when the stage module is about to load, it lets the real finder
    find it and wraps the loader, so the stage class is labelled as soon as it exists."""

    def __init__(self, on_load: Callable[[Any], None]) -> None:
        self.on_load = on_load

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != STAGE_MODULE:
            return None
        sys.meta_path.remove(self)  # the real finders find it; and this runs once
        try:
            spec = importlib.util.find_spec(name)
        except Exception:  # whatever the import would say, it says it without this finder in the way
            return None
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, on_load = spec.loader, self.on_load

        class Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: Any) -> None:
                loader.exec_module(module)
                on_load(module)

        spec.loader = Loader()
        return spec


def watch_pipelining(labels: PipelineLabels) -> Callable[[], None]:
    """Label the messages of every pipeline stage from now on; returns a function that undoes it."""
    undo: list[tuple[Any, str, Any]] = []

    def on_load(module: Any) -> None:
        try:
            _wrap_stage_class(labels, module, undo)
        except Exception:
            pass

    finder = None
    if STAGE_MODULE in sys.modules:
        on_load(sys.modules[STAGE_MODULE])
    else:
        finder = _WrapOnImport(on_load)
        sys.meta_path.insert(0, finder)

    def uninstall() -> None:
        if finder is not None and finder in sys.meta_path:
            sys.meta_path.remove(finder)
        for owner, name, original in reversed(undo):
            setattr(owner, name, original)

    return uninstall
