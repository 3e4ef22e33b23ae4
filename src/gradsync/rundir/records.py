"""What crosses a process boundary through the run folder, declared once.

The workers, the trainer and the launcher write these; the monitor, the analysis and the report
read them, often from another process and after the writer is gone. They are JSON: TypedDicts
say which keys a reader may count on (a reader still copes with any of them missing, since a
writer may have died halfway), and `Finding` with its `CATEGORIES` is the vocabulary of
diagnosis.json.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, TypedDict

# -- gradsync run's workers ---------------------------------------------------------------------

# A collective as the ring file keeps it: one JSON array per slot, in this order.
# Point-to-point messages pair one sender with one receiver, so they legitimately differ between
# ranks: recorded (a rank stuck in recv is worth naming) but numbered apart (seq None), outside
# the compared sequence. Their signature ends with the peer: " src=R" or " dst=R".
POINT_TO_POINT = frozenset({"send", "recv", "isend", "irecv", "batch_isend_irecv"})
# The records of process-group creations (new_group, new_subgroups, split_group, init_device_mesh):
# each is a collective of every rank of the world, in the same order on every rank (torch names a
# new group by counting the groups created), so they are numbered as one sequence of their own.
GROUP_CREATIONS = "group creations"
RECORD_FIELDS = ("index", "group", "seq", "op", "signature", "kind", "site", "args", "state", "entered", "finished", "crc", "error")


class RingRecord(TypedDict):
    index: int  # the rank's count of collectives so far
    group: str  # "default" or the group's description
    seq: int | None  # its number within the group (None for a collective never issued)
    op: str
    signature: str  # what must agree across ranks: dtypes and shapes, root, reduce op
    kind: str  # "", or what issued it ("DDP gradients of a backward pass", ...)
    site: str | None  # the user's file:line
    # Arguments that legitimately differ between ranks, so they are never compared as the signature
    # is, but that say what disagreed once the backend found a mismatch: an all_to_all's split sizes;
    # "thread", the name of the script's thread that made it when that is not the main thread.
    args: dict[str, Any] | None
    state: str  # "entered", "issued", "finished", "failed"
    entered: float
    finished: float | None
    crc: int | None
    error: str | None


class PipelineFacts(TypedDict):
    """What a pipeline stage's send or receive carries, in a record's args under "pipeline"
    (gradsync.run.pipeline_labels): the stages of one pipeline must agree on the schedule and the
    micro-batch count, run the same steps, and send what their neighbour expects."""

    stage: int
    stages: int
    step: int  # the stage's schedule steps begun so far, this one included
    microbatch: int | None  # None: the stage's set-up, before any micro-batch
    microbatches: int | None
    schedule: str  # the schedule's class name, "" when not found
    carries: str  # "activations", "gradients" or "setup"
    direction: str  # "to", "from", or "with" for set-up
    peer_stage: int | None


class FlightDump(TypedDict):
    """A rank's Flight Recorder entries (RunDir.flight), newest last, in the ring records' shape:
    group, seq (None for point-to-point), op, signature, state ("finished", or "entered" while the
    backend has not completed it), entered (creation time), plus backend_state (Flight Recorder's
    own word: scheduled/started/completed). `groups`: group -> global ranks."""

    time: float
    entries: list[dict[str, Any]]
    groups: dict[str, list[int]]


class Identity(TypedDict):
    """Who a worker is, from torchrun's environment."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    attempt: int
    host: str
    pid: int
    started: float
    cwd: str  # the working directory the script started in: its relative file:line paths start here
    target: str
    round_store: str  # MASTER_ADDR:MASTER_PORT: which rendezvous round the rank belongs to


class ThreadStacks(TypedDict, total=False):
    """Every thread's stack (gradsync.run.stacks), in a snapshot when asked for (`gradsync stacks`:
    the request's id, else None) or when the rank is quiet for half the stall timeout, and in
    every exit record."""

    threads: list[dict[str, Any]]  # {"thread", "main", "daemon", "stack": ["file:line in function", ...]}
    stacks_id: str | None


class Snapshot(Identity, ThreadStacks):
    """A worker's state, rewritten every second (RunDir.snapshot)."""

    time: float
    phase: str  # "starting", "running", "teardown"
    last_progress: float  # when it last made real progress: entered or left a collective, or stepped an optimizer
    groups: dict[str, Any]  # group -> {"ranks", "seq", "crc", "checkpoints": [[seq, crc], ...]}
    stack: list[str]  # the main thread's "file:line in function", outermost first
    location: str | None  # the user's innermost line
    backward_passes: int
    first_nonfinite: dict[str, Any] | None
    nonfinite_passes: int
    unused_parameters: list[str]
    ddp_parameters: list[list[str]]
    meshes: list[dict[str, Any]]  # init_device_mesh calls: {"shape", "names", "site"}, in order
    backend: str | None  # the default process group's, once created
    left_group: dict[str, Any] | None  # {"site", "time"} where the script destroyed the default group
    # Its state at this look and the evidence (gradsync.run.stall.rank_state): "state" (waiting,
    # working, idle), "worked_at", "working_since", "tree_cpu_s", "cpu_share", "native_call", "position".
    activity: dict[str, Any]
    # For `gradsync status`: optimizer steps so far (the trainer's own count when it runs), the
    # median of the last 20 steps' durations, the process's memory, its waits for communication so far.
    optimizer_steps: int
    step_time_s: float | None
    rss_mb: float | None
    communication_wait_s: float


class SystemReading(TypedDict, total=False):
    """One line of a worker's system-rankR.jsonl, written with each snapshot: the machine under
    the rank (gradsync.metrics.system's keys) and the rank's progress so far, cumulative, from
    which `gradsync report` draws step times and communication waits of an unmodified script."""

    time: float
    optimizer_steps: int  # outermost optimizer.step() calls
    backward_passes: int  # backward passes whose gradients DDP synchronised
    communication_wait_s: float  # in blocking collectives and at the end of backward passes
    cpu_percent: float
    rss_mb: float
    net_sent_mbps: float
    net_recv_mbps: float
    gpu_util_percent: float


class ExitOutcome(TypedDict, total=False):
    status: str  # "finished", "exit_code", "exception"
    time: float
    code: int
    stopped_after_steps: int  # --doctor-steps
    # How a script's own ending was made: "sys.exit" or "os._exit" (from any thread: `thread`
    # names it when not the main one); `location` is then the user's line that made it.
    how: str
    thread: str | None
    type: str  # an exception's
    message: str
    location: str | None
    traceback: str
    # The recorded collective the exception came out of ({group, seq, op, site}), None when it
    # was raised outside every recorded collective: whether it can be a peer's consequence.
    collective: dict[str, Any] | None


class ExitRecord(Snapshot):
    """The last snapshot, with how the script ended (RunDir.exit_record)."""

    exit: ExitOutcome


class FaultRecord(TypedDict):
    """What an injected fault leaves before it fires (RunDir.fault)."""

    action: str
    rank: int
    step: int
    attempt: int
    code: int
    at: str
    spec: str
    time: float
    pid: int


# -- the trainer's metrics ----------------------------------------------------------------------


class MetricsRow(TypedDict, total=False):
    """One optimizer step in metrics.jsonl (the user's own logged values sit beside these keys)."""

    step: int
    epoch: int
    samples: int
    samples_per_s: float
    step_time_s: float
    step_time_max_s: float
    slowest_rank: int
    slowest_rank_busy_s: float
    exposed_comm_s: float
    exposed_comm_share: float
    reductions: int
    skipped: str | None
    grad_norm: float | None
    lr: float | None
    comm_bytes: float
    compression_ratio: float
    busbw_gbps: float
    encode_s: float
    decode_s: float
    all_gather_bytes: float  # FSDP's parameter gathers (and TP's), nccl-tests sizes
    reduce_scatter_bytes: float
    all_reduce_bytes: float  # HSDP's across replicas, TP's activation exchanges
    p2p_bytes: float  # a pipeline's activations and their gradients, sent by rank 0
    pipeline_bubble_share: float  # the share of the schedule's time a pipeline's ranks waited inside it
    # The last row of each gather interval also carries:
    system: dict[str, dict[str, float]]  # rank -> mean readings
    rank_busy_s: dict[str, float]
    busy_spread_s: float
    interval_slowest_rank: int
    gpu_util_spread: float


class RunDescription(TypedDict, total=False):
    """run.json: what the trainer ran with, written at start and rewritten at close (with what
    auto chose and when it ended)."""

    world_size: int
    backend: str | None  # None: a single process without a process group
    device: str
    parallel: str
    precision: str
    compression: str  # "auto" until it chose, then its choice
    accumulation_steps: int
    started: float
    ended: float  # absent while running, or when the run died


# Keys of MetricsRow that `trainer.log()` may not take: gradsync writes them itself.
METRICS_KEYS = frozenset(MetricsRow.__annotations__)

# The numbers every row carries, so a reader can tell a row from damage.
METRICS_REQUIRED = ("step", "samples_per_s", "step_time_s", "exposed_comm_s")

# -- diagnosis.json -----------------------------------------------------------------------------

SEVERITIES = ("error", "warning")
ERROR, WARNING, EITHER = ("error",), ("warning",), SEVERITIES

# The vocabulary of diagnosis.json: every category a finding may have, its severities, and what it means.
# The script check's categories (--doctor-steps) are added by gradsync.doctor.script.registry when
# it is imported: each check declares its own (register_categories).
CATEGORIES: dict[str, tuple[tuple[str, ...], str]] = {
    "collective_mismatch": (ERROR, "ranks called different collectives at the same point"),
    "shape_mismatch": (ERROR, "the same collective at the same line with different tensors"),
    "rank_exited": (ERROR, "a rank finished its script while others still expected it"),
    "pipeline_schedule_mismatch": (ERROR, "a pipeline's stages run different schedules, so their sends and receives never pair"),
    "pipeline_microbatch_mismatch": (ERROR, "a pipeline's stages were built for different numbers of micro-batches per step"),
    "pipeline_shape_mismatch": (ERROR, "a pipeline stage sent a tensor of another shape or dtype than its neighbour expected"),
    "pipeline_microbatch_skipped": (ERROR, "a pipeline stage went past a micro-batch of a step that its neighbour sent or received"),
    "pipeline_steps_differ": (ERROR, "a pipeline's stages ran different numbers of steps: one skipped a batch or had fewer"),
    "rank_crashed": (ERROR, "a rank raised or was killed first; the others' errors are consequences"),
    "out_of_memory": (ERROR, "a rank failed to allocate memory, as its last words say; the others' errors are consequences"),
    "script_failed": (ERROR, "every rank failed the same way: the script's own error, not one rank's"),
    "rank_stuck": (ERROR, "a rank stayed outside any collective (stuck, or busy elsewhere) while the others waited"),
    "group_creation_mismatch": (ERROR, "the ranks created process groups differently: a new_group, new_subgroups, split_group or init_device_mesh only some ranks made, or in another order"),
    "exit_held_by_threads": (ERROR, "a rank's script ended but its process never exited: non-daemon threads it started hold it (Python joins them before atexit handlers)"),
    "stalled_outside_collectives": (ERROR, "no rank progressed until the busy timeout and none was in a collective: each waited on something of its own"),
    "hang": (ERROR, "every rank waits in the same matched collective: the network or backend is not delivering"),
    "rank_unreachable": (ERROR, "a rank on another node stopped reporting and its node never said how it ended: the host or the network went away"),
    "desync": (ERROR, "the ranks' collectives were paired out of step although nothing failed"),
    "unused_parameters": (EITHER, "DDP's crash on parameters without gradients, or parameters that never get one"),
    "nonfinite_gradients": (WARNING, "where a NaN/inf gradient first appeared, before averaging spread it"),
    "straggler": (WARNING, "a rank typically arrives late at collectives"),
    "teardown_failure": (WARNING, "every rank finished, then a process crashed while shutting down"),
    "collective_after_peer_left": (WARNING, "a collective failed, and the rank went on, because a peer had finished without it"),
    "restarted": (WARNING, "attempts before the last failed and the workers were restarted"),
    "regrouped": (WARNING, "the workers were restarted to take in a node that joined an elastic job (not a failure)"),
    "fault_not_fired": (WARNING, "an --inject-fault never fired, so nothing was rehearsed"),
    "stopped_by_signal": (WARNING, "the job was stopped from outside"),
}


def register_categories(categories: dict[str, tuple[tuple[str, ...], str]]) -> None:
    """Add the categories of another vocabulary (the script check's, gradsync.doctor.script.registry,
    which owns them): a name already taken with another meaning is a mistake in gradsync."""
    for name, entry in categories.items():
        if CATEGORIES.get(name, entry) != entry:
            raise ValueError(f"category {name!r} is registered twice, with different meanings")
        CATEGORIES[name] = entry


@dataclass
class Finding:
    """One thing gradsync found, in the shape of `diagnosis.json`'s findings."""

    category: str
    severity: str
    ranks: list[int]
    message: str
    suggestion: str
    locations: dict[str, str] = field(default_factory=dict)
    collective: str | None = None
    step: int | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        severities, _ = CATEGORIES.get(self.category, ((), ""))
        if self.severity not in severities:
            raise ValueError(f"finding {self.category!r} with severity {self.severity!r} is not in CATEGORIES")

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if not data["details"]:
            del data["details"]
        return data



class Diagnosis(TypedDict, total=False):
    status: str  # "ok", "failed", "stopped"
    trigger: str  # "stall", "failure", "exit", "signal"
    world_size: int
    findings: list[dict[str, Any]]  # Finding.as_dict()
    ranks: dict[str, str]  # rank -> one line: where it is, what it waits for
    attempt: int
    attempts: list[dict[str, Any]]
    stall_timeout_s: float
    note: str
