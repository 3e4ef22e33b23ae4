"""What a pipeline's point-to-point messages carry: which stage, which step of its schedule,
which micro-batch, activations or gradients, to or from which stage.

`torch.distributed.pipelining` sends each micro-batch's activations forward (and, in backward,
their gradients back) with isend/irecv between neighbouring stages. The recorder sees each send
and receive, its tensor and its peer, but not what it is for; a hang between stages reads far
better as "stage 1 waits for micro-batch 2's activations from stage 0". A stage builds each
message's operations in `get_fwd_recv_ops(i)` and its three kin, so those are wrapped to label
the operations' tensors, and the recorder reads the label when the operation is issued.

A label is a `PipelineMessage`: its text goes into the record's kind, its facts into the record's
args (gradsync.rundir.records.PipelineFacts), so the analysis can compare what each stage was
built for (schedule, micro-batch count) and where it is (step, micro-batch) without parsing words.

The wrapping happens when the user's script imports the stage module, not before: importing
it costs about a second, which scripts without pipelines must not pay. Labels are kept by
tensor identity, checked through a weak reference, so a recycled id never lends a stale label
to an unrelated tensor. Nothing here may raise into the script: a label that cannot be made
is left out.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from gradsync.rundir.records import PipelineFacts

STAGE_MODULE = "torch.distributed.pipelining.stage"
_PRUNE_AT = 4096  # labels kept before dead ones are dropped


@dataclass(frozen=True)
class PipelineMessage:
    """What one send or receive of a pipeline carries, as its stage built it. A stage's set-up
    (the shapes and dtypes its neighbours tell it at its first step) carries "setup", with no
    micro-batch and no known peer stage."""

    stage: int
    stages: int
    step: int  # the stage's schedule steps begun so far, this one included (1 = the first)
    microbatch: int | None
    microbatches: int | None  # what the stage was prepared for (None: not known)
    schedule: str  # the schedule class driving the stage ("ScheduleGPipe"), "" when not found
    carries: str  # "activations", "gradients" or "setup"
    direction: str  # "to", "from", or "with" for set-up
    peer_stage: int | None

    @property
    def text(self) -> str:
        where = f"pipeline stage {self.stage} of {self.stages}, step {self.step}"
        if self.microbatch is None:
            count = f" for {self.microbatches} micro-batches" if self.microbatches else ""
            return f"{where}: setting up{count} (the shapes its neighbours send)"
        of = f" of {self.microbatches}" if self.microbatches else ""
        return f"{where}: micro-batch {self.microbatch}{of}'s {self.carries} {self.direction} stage {self.peer_stage}"

    def facts(self) -> PipelineFacts:
        return PipelineFacts(stage=self.stage, stages=self.stages, step=self.step, microbatch=self.microbatch,
                             microbatches=self.microbatches, schedule=self.schedule, carries=self.carries,
                             direction=self.direction, peer_stage=self.peer_stage)


class PipelineLabels:
    """Tensor -> the message it carries between stages (set when the stage builds its operations),
    and the set-up a stage is in on this thread (whose messages torch builds inside)."""

    def __init__(self) -> None:
        self._labels: dict[int, tuple[weakref.ref, PipelineMessage]] = {}
        self._setting_up = threading.local()
        # Called with (message, signature) for each labelled message the recorder records: the
        # script check's pipeline watch (none in a plain run).
        self.listeners: list[Callable[[PipelineMessage, str], None]] = []

    def label(self, tensor: Any, message: PipelineMessage) -> None:
        try:
            self._labels[id(tensor)] = (weakref.ref(tensor), message)
        except TypeError:  # not weak-referenceable: go without
            return
        if len(self._labels) > _PRUNE_AT:
            self._labels = {key: entry for key, entry in self._labels.items() if entry[0]() is not None}

    def of(self, tensor: Any) -> PipelineMessage | None:
        """The message `tensor` carries, or None when no stage labelled it."""
        entry = self._labels.get(id(tensor))
        return entry[1] if entry is not None and entry[0]() is tensor else None

    def setting_up(self) -> PipelineMessage | None:
        """The set-up a stage is in on this thread: every message sent meanwhile is part of it."""
        return getattr(self._setting_up, "message", None)

    def message(self, tensor: Any) -> PipelineMessage | None:
        """What a send or receive of `tensor` carries: its label, else the set-up it is part of."""
        return self.of(tensor) or self.setting_up()

    @contextlib.contextmanager
    def setup(self, message: PipelineMessage | None) -> Iterator[None]:
        """Label every message sent on this thread meanwhile as part of `message`'s set-up (None:
        leave the labels as they are)."""
        outer = self.setting_up()
        if message is not None:
            self._setting_up.message = message
        try:
            yield
        finally:
            self._setting_up.message = outer


class _StageSteps:
    """Which step of its schedule each stage is in, and which schedule drives it.

    A step begins when a forward builder already called with micro-batch 0 is called with it
    again: every schedule builds micro-batch 0's forward messages once per step, whether or not
    the stage receives (the first stage's receive builder returns nothing, and some schedules
    never call it)."""

    @dataclass
    class _State:
        step: int = 0
        started_by: set[str] = field(default_factory=set)  # forward builders called at micro-batch 0 this step
        schedule: str = ""

    def __init__(self) -> None:
        self._states: weakref.WeakKeyDictionary[Any, _StageSteps._State] = weakref.WeakKeyDictionary()

    def note(self, stage: Any, method: str, chunk: int) -> tuple[int, str]:
        """(the step `stage` is in, the schedule driving it) as it builds `method`'s messages for
        micro-batch `chunk`; `method` "" is the stage's set-up, which comes before the next step."""
        state = self._states.get(stage)
        if state is None:
            state = self._states[stage] = self._State()
        if not method:  # the set-up, before the step's first message
            return state.step + 1, state.schedule
        if chunk == 0 and method in _FORWARD_BUILDERS:
            if state.step == 0 or method in state.started_by:
                state.step, state.started_by = state.step + 1, set()
                state.schedule = _driving_schedule() or state.schedule
            state.started_by.add(method)
        return max(state.step, 1), state.schedule


def _driving_schedule() -> str:
    """The class of the schedule whose step is running, found among the callers (a stage does
    not know its schedule; the schedule's methods run with it as `self`)."""
    frame = sys._getframe(2)
    for _ in range(12):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if owner is not None and any(base.__name__ == "_PipelineSchedule" for base in type(owner).__mro__):
            return type(owner).__name__
        frame = frame.f_back
    return ""


# (method, what travels, direction, the peer stage's offset)
_MESSAGES = (
    ("get_fwd_recv_ops", "activations", "from", -1),
    ("get_fwd_send_ops", "activations", "to", +1),
    ("get_bwd_recv_ops", "gradients", "from", +1),
    ("get_bwd_send_ops", "gradients", "to", -1),
)


_FORWARD_BUILDERS = ("get_fwd_recv_ops", "get_fwd_send_ops")


def _stage_message(stage: Any, step: int, schedule: str, microbatch: int | None, microbatches: Any, carries: str,
                   direction: str, peer_stage: int | None) -> PipelineMessage:
    return PipelineMessage(
        stage=int(stage.stage_index), stages=int(stage.num_stages), step=step, microbatch=microbatch,
        microbatches=int(microbatches) if isinstance(microbatches, int) else None, schedule=schedule,
        carries=carries, direction=direction, peer_stage=peer_stage,
    )


def _labelled(labels: PipelineLabels, steps: _StageSteps, method: str, original: Callable, carries: str, direction: str,
              offset: int) -> Callable:
    def build_ops(stage: Any, chunk: int, *args: Any, **kwargs: Any) -> Any:
        ops = original(stage, chunk, *args, **kwargs)
        try:
            step, schedule = steps.note(stage, method, chunk)
            message = _stage_message(stage, step, schedule, int(chunk), getattr(stage, "chunks", None), carries, direction,
                                     int(stage.stage_index) + offset)
            for op in ops:
                labels.label(op.tensor, message)
        except Exception:  # a label is never worth failing the script's step
            pass
        return ops

    build_ops.__gradsync_original__ = original  # type: ignore[attr-defined]
    return build_ops


def _in_setup(labels: PipelineLabels, steps: _StageSteps, original: Callable) -> Callable:
    """A stage's `_prepare_*_infra(num_microbatches, ...)`, with the messages it exchanges labelled:
    the stage learns its neighbours' shapes there, before any micro-batch, so a stage built for
    another micro-batch count or schedule is known even when it fails during its set-up."""

    def prepare(stage: Any, num_microbatches: Any, *args: Any, **kwargs: Any) -> Any:
        message = None
        try:
            step, schedule = steps.note(stage, "", -1)
            message = _stage_message(stage, step, _driving_schedule() or schedule, None, num_microbatches, "setup", "with", None)
        except Exception:  # a label is never worth failing the script's step
            pass
        with labels.setup(message):
            return original(stage, num_microbatches, *args, **kwargs)

    prepare.__gradsync_original__ = original  # type: ignore[attr-defined]
    return prepare


_SETUP = ("_prepare_forward_infra", "_prepare_backward_infra")


def _wrap_stage_class(labels: PipelineLabels, module: Any, undo: list[tuple[Any, str, Any]]) -> None:
    base = getattr(module, "_PipelineStageBase", None)
    if base is None:
        return
    steps = _StageSteps()
    for method, carries, direction, offset in _MESSAGES:
        original = base.__dict__.get(method)
        if original is None or hasattr(original, "__gradsync_original__"):
            continue
        undo.append((base, method, original))
        setattr(base, method, _labelled(labels, steps, method, original, carries, direction, offset))
    # The set-up is each concrete stage class's own (the base's is abstract).
    for owner in [value for value in vars(module).values() if isinstance(value, type) and issubclass(value, base)]:
        for method in _SETUP:
            original = owner.__dict__.get(method)
            if original is None or getattr(original, "__isabstractmethod__", False) or hasattr(original, "__gradsync_original__"):
                continue
            undo.append((owner, method, original))
            setattr(owner, method, _in_setup(labels, steps, original))


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
