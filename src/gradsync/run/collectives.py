"""The collective recorder: what every worker under `gradsync run` has communicated, and where.

It wraps the public `torch.distributed` collectives, DDP's gradient reduction and DDP's buffer
broadcasts, so it sees the same thing whatever the backend. For each collective it
keeps, in a ring buffer, a per-group sequence number, the op, what must agree across ranks
(dtype/shape, root, reduce op, train/eval for DDP's broadcasts), the user's file:line and the
state. A CRC of that sequence per group lets ranks be compared without talking to each other.

Recording happens on the training hot path, so it stays at a few microseconds per collective:
slotted records, a cached user-frame lookup, no locks (the GIL orders the few shared writes, and
readers only take a copy). It happens inside the user's calls too, so each hook keeps its
recording in a `harmless.Bookkeeping`: a failure there is said once and costs that record, never
the call.

DDP's gradient reduction is recorded at one of two depths. By default DDP keeps its C++ reduction
and each synchronising backward pass is one record (entered when `backward()` starts, finished when
it returns), with the loss checked for NaN/inf before averaging can spread it: routing the buckets
through a Python communication hook costs ~1.5-2 ms per step on a small CPU machine, 8-10% of a
20 ms step. `record_buckets` routes them through that hook instead: one record per bucket, and
every gradient checked before averaging, naming the parameters where NaN/inf started (the script
check uses it; `gradsync run --record-buckets` when a diagnosis asks for it). A comm hook the user
registers is wrapped either way, since its Python cost is already paid.
"""

from __future__ import annotations

import functools
import math
import re
import sys
import threading
import time
import zlib
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as distributed_c10d
from torch.nn.parallel import DistributedDataParallel

from gradsync import compat, events
from gradsync.callsite import caller_location
from gradsync.run.harmless import Bookkeeping, BookkeepingByKind, IdentityMap
from gradsync.run.pipeline_labels import PipelineLabels, watch_pipelining
from gradsync.rundir.records import GROUP_CREATIONS, POINT_TO_POINT, RECORD_FIELDS

CHECKPOINT_EVERY = 32  # a group's running hash is kept at every 32nd collective for comparisons
UNUSED_CHECK_PASSES = 50  # backward passes watched for parameters that never get a gradient
FAILED_IN = "__gradsync_collective__"  # the attribute naming the collective an exception came out of
_SOURCE_PLACE = re.compile(r"\[[^\]\s]+\.(?:cc|cpp|cu|h|hpp):\d+\] ")  # where in its sources a backend raised


def failed_collective(error: BaseException | None) -> dict[str, Any] | None:
    """The recorded collective `error`, or an exception it was raised from or while handling,
    came out of; None when none did."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        found = getattr(error, FAILED_IN, None)
        if found is not None:
            return found
        error = error.__cause__ or error.__context__
    return None


class Record:
    """One collective on one rank."""

    __slots__ = (*RECORD_FIELDS, "ring_prefix")

    def __init__(
        self, index: int, group: str, seq: int | None, op: str, signature: str, kind: str, site: str | None,
        args: dict[str, Any] | None = None,
    ):
        self.index = index
        self.group = group
        self.seq = seq
        self.op = op
        self.signature = signature
        self.kind = kind
        self.site = site
        self.args = args
        self.state = "entered"
        self.entered = time.time()
        self.finished: float | None = None
        self.crc: int | None = None
        self.error: str | None = None
        self.ring_prefix: bytes | None = None  # the ring file's encoding of the fixed fields

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in RECORD_FIELDS}


class GroupSequence:
    """The compared sequence of one process group on this rank: count and running CRC."""

    __slots__ = ("ranks", "seq", "crc", "checkpoints")

    def __init__(self, ranks: list[int]):
        self.ranks = ranks
        self.seq = 0
        self.crc = 0
        self.checkpoints: deque[tuple[int, int]] = deque(maxlen=256)


STEP_ENDS_KEPT = 21  # the last 20 optimizer steps' durations


class CollectiveRecorder:
    """Per-process record of collectives, heartbeat and DDP health facts, read by the snapshot thread."""

    def __init__(self, ring_size: int = 256):
        self.ring: deque[Record] = deque(maxlen=ring_size)
        self.count = 0
        self.groups: dict[str, GroupSequence] = {}
        self.last_progress = time.time()
        self.phase = "starting"
        self.backward_passes = 0
        # For the report's per-rank timeline of a script gradsync does not otherwise see into:
        # optimizer steps (counted by the worker) and the seconds the training thread spent
        # waiting on communication, in blocking collectives and at the end of each backward
        # pass (DDP's and FSDP's final waits for their reductions).
        self.optimizer_steps = 0
        # The ends of the latest optimizer steps (time.time()), for `gradsync status`'s recent step time.
        self.step_ends: deque[float] = deque(maxlen=STEP_ENDS_KEPT)
        self.waits = WaitClock()
        self.first_nonfinite: dict[str, Any] | None = None
        self.nonfinite_passes = 0
        self.ddp_models: list[DDPWatch] = []
        # DDP model -> its watch, kept beside the model (a deepcopy or pickle of it must not meet one).
        self.ddp_watches = IdentityMap()
        # Every init_device_mesh call: its shape, dimension names and line. Ranks must build the
        # same meshes (each dimension's groups are created collectively), so the analysis compares them.
        self.meshes: list[dict[str, Any]] = []
        # Where and when the script destroyed the default group ({"site", "time"}), if it did.
        self.left_group: dict[str, Any] | None = None
        self._group_keys: dict[int, str] = {}
        self.sink: Any = None  # receives every record as it changes (the worker's ring file)
        self._warned: set[str] = set()
        self.bookkeeping = BookkeepingByKind()  # each hook's, by kind (gradsync.run.harmless)
        self.calling = threading.local()  # .active inside a recorded call on this thread
        # Numbering a record is a read-then-write of the count and the group's sequence: a script's
        # thread making collectives beside the main thread's must not be given the same number
        # (and the same ring slot, where one record would overwrite the other).
        self._numbering = threading.Lock()
        self.creating = threading.local()  # .active inside a recorded process-group creation on this thread
        # What a pipeline stage's sends and receives carry (stage, micro-batch), named in their records' kind.
        self.pipeline_labels = PipelineLabels()
        # Told of each gradient bucket a Python comm hook reduces (gradsync's stand-in for DDP's own
        # reduction included), as `listener(bucket, reduction)` before the hook runs and again with
        # the future it returned: what the doctor compares the hook's result against.
        self.bucket_listeners: list[Callable[[dist.GradBucket, BucketReduction], None]] = []
        # Async collectives waiting for their futures: the training thread appends while the snapshot
        # thread may be settling, so a deque (atomic ends) and one settler at a time.
        self.issued: deque[tuple[Record, Any]] = deque()
        self._settling = threading.Lock()
        # DDP models whose last forward set up a gradient reduction that the next backward runs
        self.pending_reductions: dict[int, DistributedDataParallel] = {}
        # non-finite checks of GPU losses, read one pass later when the GPU is long done with them
        self.pending_loss_checks: list[tuple[torch.Tensor, str | None]] = []

    @property
    def communication_wait_s(self) -> float:
        """Seconds spent waiting on communication so far (WaitClock)."""
        return self.waits.seconds(time.time())

    # -- recording --------------------------------------------------------------------------

    def group_key(self, group: Any) -> str:
        if group is None or group is dist.GroupMember.WORLD:
            return "default"
        key = self._group_keys.get(id(group))
        if key is None:
            key = self._group_keys[id(group)] = f"group {getattr(group, 'group_name', id(group))}"
        return key

    def _sequence(self, key: str, group: Any) -> GroupSequence:
        sequence = self.groups.get(key)
        if sequence is None:
            try:
                ranks = dist.get_process_group_ranks(group if group is not None else dist.GroupMember.WORLD)
            except (RuntimeError, ValueError, AttributeError):
                ranks = []
            sequence = self.groups[key] = GroupSequence(sorted(ranks))
        return sequence

    def enter(
        self, op: str, group: Any, signature: str, kind: str = "", site: str | None = None, args: dict[str, Any] | None = None,
        key: str | None = None,
    ) -> Record:
        """Record a collective entered. All or nothing: what can fail (the group's ranks, the user's
        line, the ring file) comes before any change, so a failed entry leaves neither a sequence
        that seems to diverge from the peers' nor a record that seems to wait for good.

        `args`: what may differ between ranks by design (an all_to_all's splits); kept, never compared.
        `key`: the sequence to number it in, when not `group`'s own (GROUP_CREATIONS, over `group`'s ranks)."""
        if self.issued:
            self.settle()
        key = key or self.group_key(group)
        thread = threading.current_thread()
        if not kind and thread is not threading.main_thread():
            # The script's own collective from a thread it started: which thread is said (ranks
            # whose threads race the main thread for the process group pair collectives by chance).
            args = {**(args or {}), "thread": thread.name}
        site = site or caller_location()
        with self._numbering:
            record = Record(self.count, key, None, op, signature, kind, site, args)
            sequence = None
            if op not in POINT_TO_POINT:
                sequence = self._sequence(key, group)
                record.seq = sequence.seq + 1
                record.crc = zlib.crc32(f"{op}|{signature}|{kind}".encode(), sequence.crc)
            if self.sink is not None:
                self.sink.write(record)
            if sequence is not None:
                sequence.seq, sequence.crc = record.seq, record.crc
                if record.seq % CHECKPOINT_EVERY == 0:
                    sequence.checkpoints.append((record.seq, record.crc))
            self.count += 1
            self.ring.append(record)
        self.last_progress = record.entered
        return record

    def finish(self, record: Record, error: BaseException | None = None) -> None:
        record.finished = self.last_progress = time.time()
        if error is None:
            record.state = "finished"
        else:
            record.state = "failed"
            # Without the backend's C++ source place ("[/__w/.../tcp/pair.cc:553] "), which would fill
            # the ring slot's share for the error before the words that say what happened.
            record.error = _SOURCE_PLACE.sub("", f"{type(error).__name__}: {error}", count=1)[:500]
            # The exception remembers the collective it came out of: whether the rank failed by
            # itself or inside a collective (where a peer may be the cause) is then known from state.
            try:
                setattr(error, FAILED_IN, {"group": record.group, "seq": record.seq, "op": record.op, "site": record.site})
            except (AttributeError, TypeError):
                pass
        if self.sink is not None:
            self.sink.write(record)

    def run_blocking(self, record: Record | None, call: Callable[[], Any], bookkeeping: Bookkeeping) -> Any:
        """The user's blocking `call`, once, its result or exception as they are; `record` (None
        when entering it failed) is finished within `bookkeeping`."""
        if record is None:
            return call()
        self.waits.begin(record.entered)
        try:
            result = call()
        except BaseException as error:
            with bookkeeping:
                self.finish(record, error)
            raise
        finally:
            self.waits.end(time.time())
        with bookkeeping:
            self.finish(record)
        return result

    def finish_when_done(self, record: Record, future: Any) -> None:
        """Mark an async collective finished once `future` completes, noticed by `settle`.

        Polled rather than a done-callback: a callback runs on the backend's thread and must take
        the GIL from the training thread mid-backward, which cost more than all the recording.
        """
        record.state = "issued"
        self.issued.append((record, future))

    def watch_of(self, ddp: DistributedDataParallel) -> DDPWatch | None:
        """The watch of a DDP model; None for one it could not watch (its construction's
        bookkeeping failed, or it was built before the recorder was installed)."""
        return self.ddp_watches.get(ddp)

    def warn_once(self, message: str | None) -> None:
        """Say once per process what the recording lacks (on this rank's stderr)."""
        if message and message not in self._warned:
            self._warned.add(message)
            print(f"gradsync run: warning: {message}.", file=sys.stderr, flush=True)

    def settle(self) -> None:
        """Finish the issued collectives whose futures completed (training thread and snapshot thread)."""
        if not self._settling.acquire(blocking=False):
            return  # the other thread is at it
        try:
            for _ in range(len(self.issued)):
                record, future = self.issued.popleft()
                if record.state != "issued":
                    continue
                if not future.done():
                    self.issued.append((record, future))
                    continue
                try:
                    future.wait()
                except BaseException as error:  # the backend's error is the record's outcome
                    self.finish(record, error)
                else:
                    self.finish(record)
        finally:
            self._settling.release()

    def note_nonfinite(
        self, source: str, parameters: list[str], site: str | None, passes_ago: int = 0, bucket_index: int | None = None
    ) -> None:
        """A NaN/inf seen on this rank before averaging: in the `source` "loss" or "gradients"."""
        self.nonfinite_passes += 1
        if self.first_nonfinite is None:
            self.first_nonfinite = {
                "step": self.backward_passes + 1 - passes_ago,
                "source": source,
                "parameters": parameters,
                "bucket": bucket_index,
                "site": site,
                "time": time.time(),
            }

    def check_losses(self, tensors: Any, site: str | None) -> None:
        """Note a non-finite scalar loss about to be backpropagated (CPU now, GPU one pass later)."""
        if self.pending_loss_checks:
            for flag, flag_site in self.pending_loss_checks:
                if not bool(flag):
                    self.note_nonfinite("loss", [], flag_site, passes_ago=1)
            self.pending_loss_checks = []
        for loss in (tensors,) if isinstance(tensors, torch.Tensor) else tensors:
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
                continue  # a backward with explicit gradients: no single loss to check
            if loss.device.type == "cpu":
                if not math.isfinite(loss.item()):
                    self.note_nonfinite("loss", [], site)
            else:
                self.pending_loss_checks.append((torch.isfinite(loss.detach()), site))

    # -- views for the snapshot thread ------------------------------------------------------

    def in_blocking_collective(self) -> bool:
        """Whether the newest collective was entered and has not returned (a blocking call waits)."""
        last = self.ring[-1] if self.ring else None
        return last is not None and last.state == "entered"

    def recent(self, limit: int) -> list[dict[str, Any]]:
        return [record.as_dict() for record in list(self.ring)[-limit:]]

    def group_states(self) -> dict[str, dict[str, Any]]:
        return {
            key: {"ranks": s.ranks, "seq": s.seq, "crc": s.crc, "checkpoints": [list(c) for c in s.checkpoints]}
            for key, s in list(self.groups.items())
        }

    def unused_parameters(self) -> list[str]:
        return [name for watch in self.ddp_models for name in watch.never_used()]


# -- what must agree across ranks, per collective -----------------------------------------------


def _tensor_text(tensor: Any) -> str:
    if not isinstance(tensor, torch.Tensor):
        return type(tensor).__name__
    return f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}"


def _reduce_op_text(op: Any) -> str:
    return getattr(op, "name", None) or str(op).rsplit(".", 1)[-1]


def _arg(args: tuple, kwargs: dict, position: int, name: str, default: Any = None) -> Any:
    return args[position] if len(args) > position else kwargs.get(name, default)


def _root(args: tuple, kwargs: dict, position: int, name: str) -> str:
    value = _arg(args, kwargs, position, name)
    return f" {name}={value}" if value is not None else ""


def _peer(args: tuple, kwargs: dict, name: str) -> str:
    """' dst=R' / ' src=R' of a point-to-point op, R the peer's global rank, whether the caller gave
    `dst` or the group rank `group_dst` (torch's own send and batch_isend_irecv give the latter)."""
    value = _arg(args, kwargs, 1, name)
    if value is None and kwargs.get(f"group_{name}") is not None:
        value = kwargs[f"group_{name}"]
        group = _arg(args, kwargs, 2, "group")
        if group is not None and group is not dist.GroupMember.WORLD:
            try:
                value = dist.get_global_rank(group, value)
            except (RuntimeError, ValueError):
                pass
    return f" {name}={value}" if value is not None else ""


def _objects(objects: Any) -> str:
    return f"{len(objects)} objects" if hasattr(objects, "__len__") else type(objects).__name__


# Beyond this many characters (a large job's split lists), an all_to_all's arguments are not kept:
# a ring slot is 512 bytes.
ARGS_MAX_CHARS = 160


def _rows(tensor: Any) -> int | None:
    return int(tensor.shape[0]) if isinstance(tensor, torch.Tensor) and tensor.dim() > 0 else None


def _all_to_all_single_args(args: tuple, kwargs: dict) -> dict[str, Any] | None:
    """What this rank sends to and expects from each peer, in rows of dim 0: its split sizes, or
    the even split torch makes without them. A peer must send rank i as many rows as rank i expects."""
    group = _arg(args, kwargs, 4, "group")
    world = dist.get_world_size(group)
    exchanged = {}
    for name, tensor, splits in (("out", _arg(args, kwargs, 0, "output"), _arg(args, kwargs, 2, "output_split_sizes")),
                                 ("in", _arg(args, kwargs, 1, "input"), _arg(args, kwargs, 3, "input_split_sizes"))):
        rows = _rows(tensor)
        if splits is not None and len(splits) > 0:
            exchanged[name] = [int(n) for n in splits]
        elif rows is not None and world > 0:
            exchanged[name] = [rows // world] * world
    return _short({"unit": "rows", **exchanged})


def _all_to_all_args(args: tuple, kwargs: dict) -> dict[str, Any] | None:
    """The elements this rank sends to and expects from each peer (one tensor per peer)."""
    outputs, inputs = _arg(args, kwargs, 0, "output_tensor_list"), _arg(args, kwargs, 1, "input_tensor_list")
    return _short({"unit": "elements", "out": [int(t.numel()) for t in outputs], "in": [int(t.numel()) for t in inputs]})


def _short(args: dict[str, Any]) -> dict[str, Any] | None:
    return args if len(str(args)) <= ARGS_MAX_CHARS else None


# op name -> function giving what this rank's call exchanges with each peer (recorded, not compared)
_ARGS: dict[str, Callable[[tuple, dict], dict[str, Any] | None]] = {
    "all_to_all_single": _all_to_all_single_args,
    "all_to_all": _all_to_all_args,
}


# op name -> (position of the group argument, function giving the agreed signature, async position)
_SIGNATURES: dict[str, tuple[int, Callable[[tuple, dict], str], int | None]] = {
    "all_reduce": (2, lambda a, k: f"{_tensor_text(_arg(a, k, 0, 'tensor'))} op={_reduce_op_text(_arg(a, k, 1, 'op', dist.ReduceOp.SUM))}", 3),
    "broadcast": (2, lambda a, k: _tensor_text(_arg(a, k, 0, "tensor")) + _root(a, k, 1, "src"), 3),
    "reduce": (3, lambda a, k: _tensor_text(_arg(a, k, 0, "tensor")) + _root(a, k, 1, "dst"), 4),
    "all_gather": (2, lambda a, k: _tensor_text(_arg(a, k, 1, "tensor")), 3),
    "all_gather_into_tensor": (2, lambda a, k: _tensor_text(_arg(a, k, 1, "input_tensor")), 3),
    "all_gather_single": (2, lambda a, k: _tensor_text(_arg(a, k, 1, "input_tensor")), 3),
    "gather": (3, lambda a, k: _tensor_text(_arg(a, k, 0, "tensor")) + _root(a, k, 2, "dst"), 4),
    "scatter": (3, lambda a, k: _tensor_text(_arg(a, k, 0, "tensor")) + _root(a, k, 2, "src"), 4),
    "reduce_scatter": (3, lambda a, k: _tensor_text(_arg(a, k, 0, "output")), 4),
    "reduce_scatter_tensor": (3, lambda a, k: _tensor_text(_arg(a, k, 0, "output")), 4),
    "reduce_scatter_single": (3, lambda a, k: _tensor_text(_arg(a, k, 0, "output")), 4),
    "all_to_all": (2, lambda a, k: f"{len(_arg(a, k, 1, 'input_tensor_list') or ())} tensors", 3),
    "all_to_all_single": (4, lambda a, k: str(getattr(_arg(a, k, 1, "input"), "dtype", "")).removeprefix("torch."), 5),
    "barrier": (0, lambda a, k: "", 1),
    "monitored_barrier": (0, lambda a, k: "", None),
    # all_gather_object exchanges one object per rank whatever the output list's length (a short
    # one fails on its own rank, after the exchange); broadcast_object_list first exchanges one
    # size per object of its list, so that length must agree.
    "all_gather_object": (2, lambda a, k: "", None),
    "broadcast_object_list": (2, lambda a, k: f"{_objects(_arg(a, k, 0, 'object_list'))}{_root(a, k, 1, 'src')}", None),
    "gather_object": (3, lambda a, k: _root(a, k, 2, "dst").strip(), None),
    "scatter_object_list": (3, lambda a, k: _root(a, k, 2, "src").strip(), None),
    "send": (2, lambda a, k: _tensor_text(_arg(a, k, 0, "tensor")) + _peer(a, k, "dst"), None),
    "recv": (2, lambda a, k: _tensor_text(_arg(a, k, 0, "tensor")) + _peer(a, k, "src"), None),
    "isend": (2, lambda a, k: _tensor_text(_arg(a, k, 0, "tensor")) + _peer(a, k, "dst"), None),
    "irecv": (2, lambda a, k: _tensor_text(_arg(a, k, 0, "tensor")) + _peer(a, k, "src"), None),
}
_ALWAYS_ASYNC = frozenset({"isend", "irecv"})
_POINT_TO_POINT_TENSOR = frozenset({"send", "recv", "isend", "irecv"})  # their first argument is the message
# torch tells a P2POp's direction by comparing its function with its own module's isend/irecv
# (`op.op is isend`): the user's `dist.isend` must be the very same object there too.
_COMPARED_BY_IDENTITY = frozenset({"isend", "irecv"})


class _Completion:
    """A work's completion asked as a future's is (`done`, `wait`), for works that give no future
    (Gloo's send/recv): without it a finished isend would stay 'issued', and its rank seem to wait
    in it for good. Done once the script's own wait on it returned; never waited on here, since
    a second wait on a Gloo send or receive blocks for good (each completion is consumed once),
    so its errors reach the record through the script's wait, not this one."""

    __slots__ = ("work",)

    def __init__(self, work: Any):
        self.work = work

    def done(self) -> bool:
        return self.work.is_completed()

    def wait(self) -> None:
        pass


def _wrap_collective(recorder: CollectiveRecorder, op: str, original: Callable) -> Callable:
    group_position, signature_of, async_position = _SIGNATURES[op]
    bookkeeping = recorder.bookkeeping["the collective recorder's torch.distributed wrappers"]

    def call(args: tuple, kwargs: dict) -> Any:
        record = None
        is_async = False
        exchanged = None
        if op in _ARGS:
            with bookkeeping:  # apart: arguments that cannot be read cost only themselves, not the record
                exchanged = _ARGS[op](args, kwargs)
        with bookkeeping:
            is_async = op in _ALWAYS_ASYNC or (
                async_position is not None and _arg(args, kwargs, async_position, "async_op", False)
            )
            kind = ""
            # Only sends and receives carry a pipeline's messages: other collectives skip the lookup.
            message = recorder.pipeline_labels.message(_arg(args, kwargs, 0, "tensor")) if op in _POINT_TO_POINT_TENSOR else None
            if message is not None:
                kind, exchanged = message.text, {"pipeline": message.facts()}
            signature = signature_of(args, kwargs)
            record = recorder.enter(op, _arg(args, kwargs, group_position, "group"), signature, kind, args=exchanged)
            if message is not None:
                for listener in recorder.pipeline_labels.listeners:
                    listener(message, signature)
        if not is_async or record is None:  # (None: entering failed, and the call runs alone)
            return recorder.run_blocking(record, lambda: original(*args, **kwargs), bookkeeping)
        try:
            work = original(*args, **kwargs)
        except BaseException as error:
            with bookkeeping:
                recorder.finish(record, error)
            raise
        with bookkeeping:
            if work is None:
                recorder.finish(record)
            else:
                try:
                    future = work.get_future()
                except (RuntimeError, AttributeError):
                    future = _Completion(work)  # Gloo's send/recv give no future
                recorder.finish_when_done(record, future)
        return work

    @functools.wraps(original)
    def recorded(*args, **kwargs):
        if torch.compiler.is_compiling():
            # Dynamo traces into Python wrappers; handed the original, it recognises the
            # collective and puts it in the graph (fullgraph works, and no graph break).
            return original(*args, **kwargs)
        calling = recorder.calling
        if getattr(calling, "active", False):
            # A collective torch makes inside the user's (its send is isend(...).wait()): one record.
            return original(*args, **kwargs)
        calling.active = True
        try:
            return call(args, kwargs)
        finally:
            calling.active = False

    recorded.__gradsync_original__ = original
    return recorded


def _wrap_phase(recorder: CollectiveRecorder, phase: str, original: Callable) -> Callable:
    @functools.wraps(original)
    def with_phase(*args, **kwargs):
        recorder.phase = phase
        return original(*args, **kwargs)

    with_phase.__gradsync_original__ = original
    return with_phase


def _wrap_destroy(recorder: CollectiveRecorder, original: Callable) -> Callable:
    """destroy_process_group, noting where the script itself left the default group: a rank that
    ends early is then placed where it left (a `finally:` after a swallowed error), not only at
    its last collective. gradsync's own teardown has no user line and is not noted."""
    bookkeeping = recorder.bookkeeping["the collective recorder's destroy_process_group wrapper"]

    @functools.wraps(original)
    def destroy(*args, **kwargs):
        recorder.phase = "teardown"
        with bookkeeping:
            group = _arg(args, kwargs, 0, "group")
            site = caller_location()
            if site is not None and (group is None or group is dist.GroupMember.WORLD):
                recorder.left_group = {"site": site, "time": time.time()}
        return original(*args, **kwargs)

    destroy.__gradsync_original__ = original
    return destroy


# -- DDP ---------------------------------------------------------------------------------------


class DDPWatch:
    """Names and usage of one DDP model's parameters, for findings that name them as the user does."""

    def __init__(self, ddp: DistributedDataParallel):
        self.names: dict[int, str] = {}
        for name, parameter in ddp.module.named_parameters():
            self.names.setdefault(id(parameter), name)
        # DDP's own error messages give parameter indices in this order.
        # DDP's own parameter list where this torch has it, else the module's in the same order.
        parameters = compat.DDP_PARAMETERS.get(None, ddp) or list(dict.fromkeys(ddp.module.parameters()))
        self.process_group = compat.DDP_PROCESS_GROUP.get(None, ddp)  # None: the default group
        self.reducer_order = [self.names.get(id(p), "?") for p in parameters if p.requires_grad]
        # What one backward pass reduces, compared across ranks like a collective's shape.
        elements: dict[str, int] = {}
        for p in parameters:
            if p.requires_grad:
                dtype = str(p.dtype).removeprefix("torch.")
                elements[dtype] = elements.get(dtype, 0) + p.numel()
        self.gradient_signature = "+".join(f"{dtype}[{count}]" for dtype, count in elements.items())
        self.reduction: str | None = None  # "buckets" (a Python comm hook) or "passes" (DDP's C++ path)
        self.forward_grad_mode = "grad"  # of the model's latest forward
        self.used: set[int] = set()
        self.used_this_pass: set[int] = set()
        self.passes = 0
        self.checked_passes = 0  # synchronised passes watched for usage
        self.incomplete_passes = 0  # of those, passes in which some parameter got no gradient
        self.pending_checks: list[tuple[torch.Tensor, int, list[str], str | None]] = []
        self.watches_usage = compat.DDP_FIND_UNUSED.get(False, ddp)
        self._usage_hooks = []
        if self.watches_usage:
            # DDP silently reduces zeros for parameters that get no gradient; count who really gets
            # one for a while, then stop watching (the hooks cost a call per parameter per pass).
            self._usage_hooks = [
                p.register_post_accumulate_grad_hook(self._mark_used) for p in parameters if p.requires_grad
            ]
            self.watched = [id(p) for p in parameters if p.requires_grad]

    def _mark_used(self, parameter: torch.Tensor) -> None:
        self.used.add(id(parameter))
        self.used_this_pass.add(id(parameter))

    def pass_done(self) -> None:
        # A parameter's gradient is accumulated (and marked used) before DDP hears of it, so
        # the pass's last bucket comes after every mark of that pass.
        self.passes += 1
        if not self._usage_hooks:
            return
        self.checked_passes += 1
        if len(self.used_this_pass) < len(self.watched):
            self.incomplete_passes += 1
        self.used_this_pass.clear()
        if self.passes >= UNUSED_CHECK_PASSES:
            for handle in self._usage_hooks:
                handle.remove()
            self._usage_hooks = []

    def never_used(self) -> list[str]:
        if not self.watches_usage or self.passes == 0:
            return []
        return [self.names.get(key, "?") for key in self.watched if key not in self.used]


def _nonfinite_names(bucket: dist.GradBucket, watch: DDPWatch) -> list[str]:
    return [
        watch.names.get(id(parameter), "?")
        for parameter, gradient in zip(bucket.parameters(), bucket.gradients())
        if not bool(torch.isfinite(gradient).all())
    ]


class WaitClock:
    """The seconds the script has waited on communication, as the union of its waits in time.

    A wait is added when it ends, and the one under way counts up to the moment read, so the
    count read at two instants never grows by more than the time between them: a reading's share
    of waiting cannot leave [0, 1] by construction. Waits that overlap (a blocking collective
    inside a backward's final wait, two threads) count once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = 0.0  # seconds of the waits that ended
        self._since: float | None = None  # when the waits under way began (time.time())
        self._under_way = 0

    def begin(self, at: float) -> None:
        with self._lock:
            if self._under_way == 0:
                self._since = at
            self._under_way += 1

    def end(self, at: float) -> None:
        with self._lock:
            if self._under_way == 0:
                return
            self._under_way -= 1
            if self._under_way == 0 and self._since is not None:
                self._done += max(0.0, at - self._since)
                self._since = None

    def seconds(self, now: float) -> float:
        """The waits' seconds up to `now` (a wait under way counts up to it)."""
        with self._lock:
            under_way = max(0.0, now - self._since) if self._since is not None else 0.0
            return self._done + under_way


@dataclass
class BucketReduction:
    """One gradient bucket handed to a comm hook, as the bucket listeners see it."""

    hook: Callable  # the hook as the script gave it (gradsync's stand-in for DDP's own reduction: `own`)
    registered_at: str | None  # the user's line that registered it (None: gradsync's stand-in)
    own: bool  # gradsync's stand-in for DDP's own averaging, not the script's hook
    group: Any  # the DDP model's process group (None: the default group)
    future: Any = None  # what the hook returned (None before it ran, or when it raised)


def _bucket_recording_hook(recorder: CollectiveRecorder, watch: DDPWatch, group: Any, hook: Callable,
                           registered_at: str | None = None) -> Callable:
    """`hook` (the user's comm hook, or gradsync's stand-in for DDP's own reduction) recording
    each bucket it reduces and checking its gradients first."""
    bookkeeping = recorder.bookkeeping["the collective recorder's DDP gradient bucket hook"]
    listening = recorder.bookkeeping["the collective recorder's bucket listeners"]
    own = hook is _default_allreduce_hook

    # Under the user's hook's name and signature: DDP checks both when it is registered, and must
    # accept or refuse it as it would without gradsync.
    @functools.wraps(hook)
    def recording_hook(state, bucket):
        record = None
        last_of_pass = False
        with bookkeeping:
            buffer = bucket.buffer()
            record = recorder.enter(
                "all_reduce",
                group,
                f"{str(buffer.dtype).removeprefix('torch.')}[{buffer.numel()}]",
                kind=f"DDP gradient bucket {bucket.index()}",
            )
        if record is not None:
            with bookkeeping:
                _check_gradients(recorder, watch, bucket, record.site)
        with bookkeeping:  # the pass is counted even when its buckets go unrecorded (see _wrap_backward)
            if bucket.is_last():
                last_of_pass = True
                recorder.backward_passes += 1
                watch.pass_done()
        reduction = None
        if recorder.bucket_listeners:
            with listening:
                reduction = BucketReduction(hook, registered_at, own, group)
                for listener in recorder.bucket_listeners:
                    listener(bucket, reduction)
        try:
            future = hook(state, bucket)
        except BaseException as error:
            if record is not None:
                with bookkeeping:
                    recorder.finish(record, error)
            raise
        if reduction is not None:
            with listening:
                reduction.future = future
                for listener in recorder.bucket_listeners:
                    listener(bucket, reduction)
        if record is not None:
            with bookkeeping:
                recorder.finish_when_done(record, future)
        if last_of_pass:
            # An injected fault fires once the pass's last reduction is issued, so the peers' step
            # is not left half-matched (a hang then shows as this rank stuck, not a mismatch).
            events.backward_pass(recorder.backward_passes)
        return future

    return recording_hook


def _check_gradients(recorder: CollectiveRecorder, watch: DDPWatch, bucket: dist.GradBucket, site: str | None) -> None:
    """Note NaN/inf in a bucket before the reduction spreads it: the rank and parameter where it started."""
    buffer = bucket.buffer()
    total = buffer.sum(dtype=torch.float32)
    if buffer.device.type == "cpu":
        if not math.isfinite(total.item()):
            recorder.note_nonfinite("gradients", _nonfinite_names(bucket, watch), site, bucket_index=bucket.index())
    else:
        # Reading the flag now would stall the CPU until the GPU catches up; read it one
        # pass later, when the kernels are long done, and name the bucket's parameters.
        names = [watch.names.get(id(p), "?") for p in bucket.parameters()]
        watch.pending_checks.append((torch.isfinite(total), bucket.index(), names, site))
        if bucket.index() == 0 and len(watch.pending_checks) > 1:
            for flag, index, bucket_names, flag_site in watch.pending_checks[:-1]:
                if not bool(flag):
                    recorder.note_nonfinite("gradients", bucket_names, flag_site, passes_ago=1, bucket_index=index)
            watch.pending_checks = watch.pending_checks[-1:]


def _default_allreduce_hook(state, bucket):
    # What DDP does without a hook: average the bucket across the group. The process group's own
    # allreduce skips the Python checks of dist.all_reduce, which cost more than the recording.
    # Unannotated: DDP refuses a hook whose annotations are not its own types, and this module's
    # annotations are strings.
    group = state if state is not None else dist.GroupMember.WORLD
    buffer = bucket.buffer().div_(group.size())
    return group.allreduce([buffer]).get_future().then(lambda f: f.value()[0])


GRADIENT_PASS_KIND = "DDP gradients of a backward pass"


# Each process-group creation the script can call: (the signature compared between ranks, whether
# the call is collective over the world). new_group with use_local_synchronization=True is
# collective over its members only, and is not numbered with the world's creations.
_GROUP_CREATIONS: dict[str, tuple[Callable[[tuple, dict], str], Callable[[tuple, dict], bool]]] = {
    "new_group": (lambda a, k: f"ranks={_ranks_text(_arg(a, k, 0, 'ranks'))}",
                  lambda a, k: not _arg(a, k, 4, "use_local_synchronization", False)),
    "new_subgroups": (lambda a, k: f"group_size={_arg(a, k, 0, 'group_size')}", lambda a, k: True),
    "new_subgroups_by_enumeration": (lambda a, k: f"ranks_per_subgroup_list={_arg(a, k, 0, 'ranks_per_subgroup_list')}",
                                     lambda a, k: True),
    "split_group": (lambda a, k: f"split_ranks={_arg(a, k, 1, 'split_ranks')}", lambda a, k: True),
}


def _ranks_text(ranks: Any) -> str:
    return "all" if ranks is None else str(sorted(int(rank) for rank in ranks))


def _wrap_group_creation(recorder: CollectiveRecorder, op: str, original: Callable) -> Callable:
    """A process-group creation, recorded as a collective of the world's creations (GROUP_CREATIONS):
    every rank must make the same ones in the same order, members or not, since torch names each
    group by counting the ones created before it. A creation only some ranks make shifts every later
    group's name on those ranks, and a later group's ranks then wait for each other under different
    names (in its creation, on Gloo) or pair the wrong collectives."""
    signature_of, collective = _GROUP_CREATIONS[op]
    bookkeeping = recorder.bookkeeping["the collective recorder's group creation wrappers"]

    @functools.wraps(original)
    def created(*args: Any, **kwargs: Any) -> Any:
        if getattr(recorder.creating, "active", False):  # one creation made of others (new_subgroups' new_group)
            return original(*args, **kwargs)
        record = None
        with bookkeeping:
            if collective(args, kwargs):
                record = recorder.enter(op, None, signature_of(args, kwargs), key=GROUP_CREATIONS)
        recorder.creating.active = True
        try:
            return recorder.run_blocking(record, lambda: original(*args, **kwargs), bookkeeping)
        finally:
            recorder.creating.active = False

    created.__gradsync_original__ = original
    return created


def _patch_device_mesh(recorder: CollectiveRecorder) -> list[tuple[Any, str, Any]]:
    """Record each `init_device_mesh` call (shape, names, the user's line) before it runs, and as
    one of the world's group creations (it creates a group per mesh dimension)."""
    import torch.distributed.device_mesh as device_mesh

    original = device_mesh.init_device_mesh
    bookkeeping = recorder.bookkeeping["the collective recorder's init_device_mesh hook"]

    @functools.wraps(original)
    def init_device_mesh(device_type: str, mesh_shape: Any, *args: Any, **kwargs: Any) -> Any:
        record = None
        with bookkeeping:
            names = kwargs.get("mesh_dim_names")
            mesh = {
                "shape": [int(size) for size in mesh_shape],
                "names": [str(name) for name in names] if names else None,
                "site": caller_location(),
            }
            recorder.meshes.append(mesh)
            if not getattr(recorder.creating, "active", False):
                record = recorder.enter("init_device_mesh", None, f"shape={mesh['shape']} names={mesh['names']}",
                                        site=mesh["site"], key=GROUP_CREATIONS)
        if record is None:
            return original(device_type, mesh_shape, *args, **kwargs)
        recorder.creating.active = True
        try:
            return recorder.run_blocking(record, lambda: original(device_type, mesh_shape, *args, **kwargs), bookkeeping)
        finally:
            recorder.creating.active = False

    patched = [(device_mesh, "init_device_mesh", original)]
    device_mesh.init_device_mesh = init_device_mesh
    if getattr(dist, "init_device_mesh", None) is original:  # the same function, re-exported
        patched.append((dist, "init_device_mesh", original))
        dist.init_device_mesh = init_device_mesh
    return patched




def _keep_hooks_as_given(ddp: DistributedDataParallel, registered: Callable, given: tuple[Callable, Any] | None) -> None:
    """DDP keeps each comm hook it was given, with its state, in a list of its own that travels
    with the model (`copy.deepcopy`, `pickle`, `torch.save`): there, the entry gradsync made holds
    its recording wrapper (a closure no pickle takes) or the process group it reduces on (which
    no deepcopy takes). Put back what the script gave (`given`), or nothing where it gave none.
    The reducer keeps the recording hook it was registered with."""
    hooks = compat.DDP_COMM_HOOKS.get(None, ddp)
    if hooks and hooks[-1][0] is registered:
        if given is None:
            hooks.pop()
        else:
            hooks[-1] = given


def is_gradient_reduction(kind: str) -> bool:
    """Whether a record's kind is DDP's gradient reduction, recorded per bucket or per pass."""
    return kind.startswith("DDP gradient")


def _patch_ddp(recorder: CollectiveRecorder, record_buckets: bool) -> list[tuple[Any, str, Any]]:
    originals = []

    def replace(name: str, make: Callable[[Callable], Callable]) -> None:
        original = getattr(DistributedDataParallel, name)
        originals.append((DistributedDataParallel, name, original))
        setattr(DistributedDataParallel, name, make(original))

    def bookkeeping(hook: str) -> Bookkeeping:
        return recorder.bookkeeping[f"the collective recorder's DDP {hook} hook"]

    def make_init(original):
        construction = bookkeeping("construction")

        @functools.wraps(original)
        def __init__(self, *args, **kwargs):
            record = None
            with construction:
                parameters = [p for p in (args[0] if args else kwargs["module"]).parameters() if p.requires_grad]
                record = recorder.enter(
                    "broadcast",
                    kwargs.get("process_group"),
                    f"{len(parameters)} parameters, {sum(p.numel() for p in parameters)} elements",
                    kind="DDP construction (parameter check and broadcast)",
                )
            recorder.run_blocking(record, lambda: original(self, *args, **kwargs), construction)
            with construction:
                recorder.warn_once(compat.lacking_on(self, compat.DDP_INSTANCE))
                watch = DDPWatch(self)
                recorder.ddp_watches[self] = watch
                recorder.ddp_models.append(watch)

        return __init__

    # A model without a watch (its construction's bookkeeping failed, or it was built before the
    # recorder was installed) is left to DDP alone by the hooks below.

    def make_register(original):
        registration = bookkeeping("comm hook registration")

        @functools.wraps(original)
        def register_comm_hook(self, state, hook):
            registered = hook
            with registration:
                watch = recorder.watch_of(self)
                # Only a hook DDP can accept is wrapped: DDP refuses the others (not callable, or
                # nameless like a partial, as it reads a hook's names) as it would without gradsync.
                if watch is not None and callable(hook) and hasattr(hook, "__name__") and hasattr(hook, "__qualname__"):
                    # gradsync's stand-in for DDP's own averaging is registered from a forward: no user's line.
                    site = None if hook is _default_allreduce_hook else caller_location()
                    registered = _bucket_recording_hook(recorder, watch, watch.process_group, hook, site)
                    watch.reduction = "buckets"
            result = original(self, state, registered)
            if registered is not hook:
                with registration:
                    _keep_hooks_as_given(self, registered, (hook, state))
            return result

        return register_comm_hook

    def make_builtin(original):
        registration = bookkeeping("comm hook registration")

        @functools.wraps(original)
        def _register_builtin_comm_hook(self, comm_hook_type):
            with registration:
                watch = recorder.watch_of(self)
                if watch is not None:
                    watch.reduction = "passes"  # a C++ hook cannot be wrapped: recorded per pass
            return original(self, comm_hook_type)

        return _register_builtin_comm_hook

    def make_forward(original):
        forwarding = bookkeeping("forward")

        # Bookkeeping that dynamo must not trace (torch.compile of a DDP model): run eagerly, at a
        # graph break before and after DDP's own forward, which dynamo traces as without gradsync.
        @torch.compiler.disable
        def before(ddp: DistributedDataParallel) -> DDPWatch | None:
            watch = None
            with forwarding:
                watch = recorder.watch_of(ddp)
                if watch is not None:
                    if watch.reduction is None:
                        if record_buckets:
                            DistributedDataParallel.register_comm_hook(ddp, watch.process_group, _default_allreduce_hook)
                            _keep_hooks_as_given(ddp, _default_allreduce_hook, None)  # the script gave none
                        else:
                            watch.reduction = "passes"
                    # DDP syncs buffers under no_grad; what must agree is the mode the forward was called in.
                    watch.forward_grad_mode = "grad" if torch.is_grad_enabled() else "no_grad"
            return watch

        @torch.compiler.disable
        def after(ddp: DistributedDataParallel, watch: DDPWatch) -> None:
            with forwarding:
                # The condition under which DDP's forward prepares its reducer for a backward pass.
                if watch.reduction == "passes" and torch.is_grad_enabled() and compat.DDP_SYNCS_GRADIENTS.get(True, ddp):
                    recorder.pending_reductions[id(ddp)] = ddp

        @functools.wraps(original)
        def forward(self, *args, **kwargs):
            watch = before(self)
            output = original(self, *args, **kwargs)
            if watch is not None:
                after(self, watch)
            return output

        return forward

    def make_sync_buffers(original):
        broadcasting = bookkeeping("buffer broadcast")

        @functools.wraps(original)
        def _sync_module_buffers(self, authoritative_rank):
            record = None
            with broadcasting:
                watch = recorder.watch_of(self)
                if watch is not None:
                    # Whether the forward trains or evaluates is part of what must agree: rank 0 evaluating
                    # through the wrapper alone pairs its broadcast with another rank's training one.
                    # Wrapped at this depth because a rank that ran out of inputs under Join reaches it too,
                    # outside any forward: it shadows a training forward like its own last one.
                    mode = "train" if self.training else "eval"
                    record = recorder.enter(
                        "broadcast",
                        self.process_group,
                        f"{len(compat.DDP_BUFFERS.get(None, self) or list(self.module.buffers()))} buffers",
                        kind=f"DDP buffer broadcast ({mode}, {watch.forward_grad_mode})",
                    )
            return recorder.run_blocking(record, lambda: original(self, authoritative_rank), broadcasting)

        return _sync_module_buffers

    def make_join_shadow(original):
        shadowing = bookkeeping("Join shadow")

        @functools.wraps(original)
        def _match_all_reduce_for_bwd_pass(self):
            # A rank that ran out of inputs under Join shadows the others' backward reduction; on
            # the C++ path it must show as the same one record, or the sequences seem to diverge
            # (the recording hook sees each shadowed bucket).
            record = None
            with shadowing:
                watch = recorder.watch_of(self)
                if watch is not None and watch.reduction == "passes":
                    record = recorder.enter("all_reduce", self.process_group, watch.gradient_signature, GRADIENT_PASS_KIND)
            return recorder.run_blocking(record, lambda: original(self), shadowing)

        return _match_all_reduce_for_bwd_pass

    replace("__init__", make_init)
    replace("register_comm_hook", make_register)
    replace("forward", make_forward)
    # DDP's private steps, each wrapped where this torch has it (the launcher says what a missing one costs).
    for api, make in (
        (compat.DDP_BUILTIN_HOOK, make_builtin),
        (compat.DDP_SYNC_BUFFERS, make_sync_buffers),
        (compat.DDP_JOIN_SHADOW, make_join_shadow),
    ):
        if api.available():
            replace(api.name, make)
    return originals


def _wrap_backward(recorder: CollectiveRecorder, original: Callable, engine: Any) -> Callable:
    """`torch.autograd.backward` (what `loss.backward()` calls), recording DDP's reduction in it."""
    bookkeeping = recorder.bookkeeping["the collective recorder's backward hook"]

    @functools.wraps(original)
    def backward(tensors, *args, **kwargs):
        if torch.compiler.is_compiling():
            return original(tensors, *args, **kwargs)
        # The DDP models whose reduction this pass runs: counted as a pass even when recording it
        # fails, so that steps keep their numbers in the diagnosis and for injected faults.
        models = list(recorder.pending_reductions.values())
        recorder.pending_reductions.clear()
        records: list[Record] = []  # entered, to be finished whatever else fails
        if models:
            site = None
            with bookkeeping:
                site = caller_location()
                for ddp in models:
                    watch = recorder.watch_of(ddp)
                    records.append(recorder.enter("all_reduce", watch.process_group, watch.gradient_signature, GRADIENT_PASS_KIND, site))
            with bookkeeping:
                recorder.check_losses(tensors, site)
        try:
            result = _timing_final_wait(recorder, engine, tensors, lambda: original(tensors, *args, **kwargs), bookkeeping)
        except BaseException as error:
            with bookkeeping:
                for record in records:
                    recorder.finish(record, error)
            raise
        with bookkeeping:
            for record in records:
                recorder.finish(record)  # DDP waits for its last bucket before backward returns
        if models:
            recorder.backward_passes += 1
            with bookkeeping:
                for ddp in models:
                    recorder.watch_of(ddp).pass_done()
            events.backward_pass(recorder.backward_passes)
        return result

    backward.__gradsync_original__ = original
    return backward


def _timing_final_wait(recorder: CollectiveRecorder, engine: Any, tensors: Any, run: Callable[[], Any], bookkeeping: Bookkeeping) -> Any:
    """Run a backward pass and add to the recorder the time between the end of its gradient
    computation and its return: what DDP's reducer (and FSDP's final callback) wait for the
    reductions still in flight, the exposed communication of the pass.

    The end of the computation is an autograd engine callback queued from a pre-hook on the
    loss's node, the first node the engine runs; callbacks run in the order queued, so it runs
    before the ones DDP and FSDP queue once their first gradient is ready. On CUDA this is the
    CPU's wait only (NCCL's wait is a stream dependency, not a CPU block). `engine`: autograd's,
    None on a torch without it (then only blocking collectives count as waiting). The pre-hook
    runs inside the engine, so it too keeps to `bookkeeping`.
    """
    computed: list[float] = []

    def computation_done() -> None:
        if not computed:  # one wait per pass, however often the engine runs the callback
            computed.append(time.time())
            recorder.waits.begin(computed[0])

    def queue_mark(_grad_outputs: Any) -> None:
        with bookkeeping:
            engine.queue_callback(computation_done)

    handle = None
    with bookkeeping:
        first = next((t for t in (tensors if isinstance(tensors, (list, tuple)) else (tensors,))
                      if isinstance(t, torch.Tensor) and t.grad_fn is not None), None)
        if first is not None and engine is not None and dist.is_initialized():
            handle = first.grad_fn.register_prehook(queue_mark)
    if handle is None:
        return run()
    try:
        return run()
    finally:
        if computed:
            recorder.waits.end(time.time())
        with bookkeeping:
            handle.remove()


def install(recorder: CollectiveRecorder, record_buckets: bool = False) -> Callable[[], None]:
    """Patch torch.distributed and DDP to record into `recorder`; returns a function that undoes it.

    `record_buckets`: record DDP's gradient reduction per bucket through a Python comm hook, with
    every gradient checked before averaging, instead of per backward pass on DDP's C++ path (see
    the module docstring for the cost).

    Must run before the user's script imports names from torch.distributed, which is why the
    worker entry point installs it before running the script.
    """
    originals: list[tuple[Any, str, Any]] = []
    for op in _SIGNATURES:
        # torch 2.13 renamed the tensor collectives (all_gather_single for all_gather_into_tensor,
        # whose old name now forwards inside torch without passing through this wrapper twice).
        original = getattr(dist, op, None)
        if original is None:
            continue
        originals.append((dist, op, original))
        wrapped = _wrap_collective(recorder, op, original)
        setattr(dist, op, wrapped)
        if op in _COMPARED_BY_IDENTITY and getattr(distributed_c10d, op, None) is original:
            originals.append((distributed_c10d, op, original))
            setattr(distributed_c10d, op, wrapped)
    originals.append((dist, "init_process_group", dist.init_process_group))
    dist.init_process_group = _wrap_phase(recorder, "running", dist.init_process_group)
    originals.append((dist, "destroy_process_group", dist.destroy_process_group))
    dist.destroy_process_group = _wrap_destroy(recorder, dist.destroy_process_group)
    for op in _GROUP_CREATIONS:
        original = getattr(dist, op, None)
        if original is not None:
            originals.append((dist, op, original))
            setattr(dist, op, _wrap_group_creation(recorder, op, original))
    originals += _patch_ddp(recorder, record_buckets)
    originals += _patch_device_mesh(recorder)
    originals.append((torch.autograd, "backward", torch.autograd.backward))
    # Looked up once here, not on every backward pass.
    torch.autograd.backward = _wrap_backward(recorder, torch.autograd.backward, compat.AUTOGRAD_CALLBACK.get(None))
    unlabel = watch_pipelining(recorder.pipeline_labels)

    def uninstall() -> None:
        unlabel()
        for owner, name, original in reversed(originals):
            setattr(owner, name, original)

    return uninstall

