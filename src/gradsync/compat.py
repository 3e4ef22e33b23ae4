"""The private torch APIs gradsync relies on, what each one serves, and the check of a torch against them.

torch's public API does not show DDP's buffer broadcasts, the elastic agent's restarts or an
unmodified script's optimizer steps, so `gradsync run` (and a few corners of the trainer) reach
into torch's internals. Those can vanish in any release; torch is a range in the dependencies
(GPU users keep their CUDA build), so each one is listed here with what depends on it and what a
torch without it costs. A use either degrades, with one line saying what is lost (`check`), or
is refused at start with a ConfigError saying what to do instead; none ends in an AttributeError.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch

from gradsync.errors import ConfigError

# The torch releases the test suite ran on (requirements-dev.txt pins the CI environment).
TESTED_TORCH = "2.13.0"

# The faces that rely on private APIs; a check covers the faces a command actually uses.
RUN = "gradsync run"
DOCTOR_STEPS = "gradsync run --doctor-steps"
PROFILE_STEPS = "gradsync run --profile-steps"
RESTARTS = "gradsync run --max-restarts"
TRAINER = "the trainer"

_ABSENT = object()


@dataclass(frozen=True)
class PrivateApi:
    """One private (or undocumented) torch attribute, the gradsync face that uses it, and the cost without it.

    `without`: what is lost (or, when `required`, what to do instead); None when nothing is lost.
    `required`: the face cannot work without it and is refused at start.
    `on_instance`: set by the owner's __init__, so only an instance of the owner shows it.
    """

    owner: str  # "module" or "module:Class"
    name: str
    face: str
    use: str
    without: str | None
    required: bool = False
    on_instance: bool = False

    @property
    def where(self) -> str:
        module, _, qualname = self.owner.partition(":")
        return f"{qualname or module}.{self.name}"

    def owner_object(self) -> Any:
        """The module or class that holds the attribute (None when this torch has no such owner)."""
        module_name, _, qualname = self.owner.partition(":")
        try:
            owner: Any = importlib.import_module(module_name)
        except ImportError:
            return None
        for part in filter(None, qualname.split(".")):
            owner = getattr(owner, part, None)
        return owner

    def get(self, default: Any = None, instance: Any = None) -> Any:
        """The attribute on this torch (on `instance` for an `on_instance` one), else `default`."""
        holder = instance if self.on_instance else self.owner_object()
        value = getattr(holder, self.name, _ABSENT) if holder is not None else _ABSENT
        return default if value is _ABSENT else value

    def available(self, instance: Any = None) -> bool:
        return self.get(_ABSENT, instance) is not _ABSENT


_DDP = "torch.nn.parallel:DistributedDataParallel"
_TORCH_TESTED = f"install torch {TESTED_TORCH}, the version gradsync is tested with"

DDP_BUILTIN_HOOK = PrivateApi(
    _DDP, "_register_builtin_comm_hook", RUN, "gradsync run wraps to learn that DDP reduces in C++",
    None,  # a script cannot register a built-in hook on such a torch either
)
DDP_SYNC_BUFFERS = PrivateApi(
    _DDP, "_sync_module_buffers", RUN, "gradsync run wraps to record DDP's buffer broadcasts",
    "they go unrecorded, so ranks that disagree on train/eval mode are not named",
)
DDP_JOIN_SHADOW = PrivateApi(
    _DDP, "_match_all_reduce_for_bwd_pass", RUN,
    "gradsync run wraps to record the gradient reduction a rank out of inputs shadows under Join",
    "under Join, a finished rank's shadow reductions go unrecorded and its collectives may be reported "
    "as diverging from the other ranks'",
)
# Read on each DDP model gradsync run records; without one it falls back to what the public API
# gives (the module's own parameters and buffers, the default group), with a warning.
DDP_PARAMETERS = PrivateApi(
    _DDP, "_module_parameters", RUN, "gradsync run reads to name the parameters DDP reduces and size each reduction",
    "the module's parameters stand in for DDP's list (the same unless some are shared or ignored)", on_instance=True,
)
DDP_BUFFERS = PrivateApi(
    _DDP, "modules_buffers", RUN, "gradsync run reads to describe DDP's buffer broadcasts",
    "the module's buffers are counted instead", on_instance=True,
)
DDP_SYNCS_GRADIENTS = PrivateApi(
    _DDP, "require_backward_grad_sync", RUN, "gradsync run reads to tell a synchronising forward from one under no_sync()",
    "every forward with gradients is taken to synchronise, so passes under no_sync() are recorded as reductions",
    on_instance=True,
)
DDP_PROCESS_GROUP = PrivateApi(
    _DDP, "process_group", RUN, "gradsync run reads to record DDP's collectives in their group",
    "DDP's collectives are recorded on the default group", on_instance=True,
)
DDP_FIND_UNUSED = PrivateApi(
    _DDP, "find_unused_parameters", RUN, "gradsync run reads to watch for parameters that never get a gradient",
    "parameters that never get a gradient are not named", on_instance=True,
)
DDP_COMM_HOOKS = PrivateApi(
    _DDP, "_comm_hooks", RUN, "gradsync run edits so that a copy or pickle of a model holds the comm hooks the script gave",
    "a copy.deepcopy or pickle of a DDP model may fail on gradsync's recording comm hook", on_instance=True,
)
DDP_INSTANCE = (DDP_PARAMETERS, DDP_BUFFERS, DDP_SYNCS_GRADIENTS, DDP_PROCESS_GROUP, DDP_FIND_UNUSED, DDP_COMM_HOOKS)
DATALOADER_ITERATOR = PrivateApi(
    "torch.utils.data.dataloader", "_BaseDataLoaderIter", DOCTOR_STEPS,
    "--doctor-steps wraps to tell which DataLoader feeds training",
    "ranks with different numbers of batches and a training DistributedSampler without set_epoch are not found",
)
OPTIMIZER_STEP_PATCH = PrivateApi(
    "torch.optim:Optimizer", "_patch_step_function", PROFILE_STEPS,
    "--profile-steps wraps to find an unmodified script's optimizer steps",
    f"profile with gradsync's trainer (metrics.profile_steps) or your own torch.profiler, or {_TORCH_TESTED}",
    required=True,
)
OPTIMIZER_STEP_COUNT = PrivateApi(
    "torch.optim:Optimizer", "_patch_step_function", RUN,
    "gradsync run wraps to count an unmodified script's optimizer steps for the report's timeline",
    "the report's per-rank timeline counts synchronised backward passes as steps",
)
AUTOGRAD_CALLBACK = PrivateApi(
    "torch.autograd:Variable", "_execution_engine", RUN,
    "gradsync run queues a callback on to time the wait at the end of each backward pass (DDP's and FSDP's reductions)",
    "the report's per-rank timeline counts only blocking collectives as waiting, not the wait at the end of backward",
)
AGENT_MONITOR = PrivateApi(
    "torch.distributed.elastic.agent.server.local_elastic_agent:LocalElasticAgent", "_monitor_workers", RESTARTS,
    "gradsync run wraps to see each attempt's failures (and, on several nodes, to tell the others at once)",
    "an attempt the agent restarts is not diagnosed on its own, only the last one is, and other nodes "
    "learn a rank killed here only from its last state",
)
AGENT_INITIALIZE = PrivateApi(
    "torch.distributed.elastic.agent.server.local_elastic_agent:LocalElasticAgent", "_initialize_workers", RESTARTS,
    "gradsync run wraps to see a restart begin",
    "an attempt the agent restarts is not diagnosed on its own, only the last one is",
)
# Flight Recorder, read by gradsync run's workers (gradsync.run.flight). NCCL's dumpers exist in CUDA builds only.
_FLIGHT_WITHOUT = (
    "collectives that bypass torch.distributed's Python functions (DTensor, functional, compiled) are "
    "judged from the ranks' stacks, and on NCCL a collective's completion is not known"
)
FR_PICKLE = PrivateApi("torch._C._distributed_c10d", "_dump_fr_trace", RUN,
                       "gradsync run reads (and saves for torch's fr_trace) Gloo's Flight Recorder with", _FLIGHT_WITHOUT)
FR_NCCL_PICKLE = PrivateApi("torch._C._distributed_c10d", "_dump_nccl_trace", RUN,
                            "gradsync run reads (and saves for torch's fr_trace) NCCL's Flight Recorder with", None)
C10D_WORLD = PrivateApi("torch.distributed.distributed_c10d", "_world", RUN,
                        "gradsync run reads to know the members of each process group Flight Recorder names",
                        "the members of groups gradsync's recorder never saw are taken to be every rank")
PROFILER_ENABLED = PrivateApi(
    "torch.autograd", "_profiler_enabled", TRAINER,
    "the trainer's step phases call to skip their profiler ranges when nothing records",
    "every phase opens a range even with no profiler on (about 6 µs each, 4 a step)",
)
# DDP's reducer, driven by the trainer on resume (gradsync.bucket_layout).
BUCKET_LAYOUT = tuple(
    PrivateApi("torch.distributed:Reducer", name, TRAINER,
               "the trainer calls to put a resumed run's DDP back in the bucket layout the checkpointed run had",
               "a resumed run's first step reduces in DDP's first bucket layout, so with 3 or more ranks it is not "
               "bitwise equal to an uninterrupted run")
    for name in ("_rebuild_buckets", "prepare_for_forward", "prepare_for_backward")
)
# FSDP2's per-unit post-backward, run by the trainer when a window's boundary batch was skipped.
_FSDP_GROUP = "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup"
_FSDP_FLUSH_USE = "the trainer runs to reduce FSDP's accumulated gradients when a window's last batch was skipped"
_FSDP_FLUSH_WITHOUT = ("with parallel='fsdp', 'hsdp' or 'fsdp+tp', skipping a window's last batch is refused (skipping "
                       "earlier batches still works)")
FSDP_FLUSH = (
    PrivateApi("torch.distributed.fsdp:FSDPModule", "_get_fsdp_state", TRAINER, _FSDP_FLUSH_USE, _FSDP_FLUSH_WITHOUT),
    PrivateApi(_FSDP_GROUP, "post_backward", TRAINER, _FSDP_FLUSH_USE, _FSDP_FLUSH_WITHOUT),
    PrivateApi(_FSDP_GROUP, "finalize_backward", TRAINER, _FSDP_FLUSH_USE, _FSDP_FLUSH_WITHOUT),
    PrivateApi("torch.distributed.fsdp._fully_shard._fsdp_common", "TrainingState", TRAINER, _FSDP_FLUSH_USE,
               _FSDP_FLUSH_WITHOUT),
)


def missing_fsdp_flush() -> str | None:
    """What this torch lacks of FSDP_FLUSH, in words; None when it has it all."""
    lacking = [api for api in FSDP_FLUSH if not api.available()]
    return f"torch {torch.__version__} has no {', '.join(api.where for api in lacking)}" if lacking else None


PRIVATE_APIS: tuple[PrivateApi, ...] = (
    DDP_BUILTIN_HOOK, DDP_SYNC_BUFFERS, DDP_JOIN_SHADOW, *DDP_INSTANCE, DATALOADER_ITERATOR,
    OPTIMIZER_STEP_PATCH, OPTIMIZER_STEP_COUNT, AUTOGRAD_CALLBACK, AGENT_MONITOR, AGENT_INITIALIZE, PROFILER_ENABLED, *BUCKET_LAYOUT, *FSDP_FLUSH,
    FR_PICKLE, C10D_WORLD,  # not NCCL's dumpers: a CPU build lacks them by design
)


def missing(*faces: str) -> list[PrivateApi]:
    """The attributes of `faces` this torch lacks (instance ones are checked by `require_instance`)."""
    return [api for api in PRIVATE_APIS if api.face in faces and not api.on_instance and not api.available()]


def check(*faces: str) -> list[str]:
    """One line per feature of `faces` this torch degrades, to show at start; ConfigError when one cannot run."""
    lacking = missing(*faces)
    refused = [api for api in lacking if api.required]
    if refused:
        raise ConfigError(_line([api for api in refused if api.face == refused[0].face]) + ".")
    by_cost: dict[str, list[PrivateApi]] = {}
    for api in lacking:
        if api.without is not None:
            by_cost.setdefault(api.without, []).append(api)
    return [f"{_line(apis)} (gradsync is tested with torch {TESTED_TORCH})" for apis in by_cost.values()]


def check_run(*, doctor_steps: bool, profile_steps: bool, restarts: bool) -> list[str]:
    """`check` for a `gradsync run` launch with these options."""
    faces = [RUN]
    faces += [DOCTOR_STEPS] if doctor_steps else []
    faces += [PROFILE_STEPS] if profile_steps else []
    faces += [RESTARTS] if restarts else []
    return check(*faces)


def lacking_on(instance: Any, apis: tuple[PrivateApi, ...]) -> str | None:
    """What `instance`, just built, lacks of the attributes of `apis` that torch sets in __init__,
    with what each absence costs; None when it has them all."""
    lacking = [api for api in apis if not api.available(instance)]
    if not lacking:
        return None
    costs = "; ".join(f"without {api.where}, {api.without}" for api in lacking)
    return f"torch {torch.__version__} lacks what gradsync run reads on DDP models, so it records less: {costs}"


def _line(lacking: list[PrivateApi]) -> str:
    """What this torch lacks, what relied on it and what that costs (the APIs share face and cost)."""
    first = lacking[0]
    if len(lacking) == 1:
        return f"torch {torch.__version__} has no {first.where}, which {first.use}: {first.without}"
    names = ", ".join(api.where for api in lacking)
    return f"torch {torch.__version__} has none of {names}, which {first.face} relies on: {first.without}"
