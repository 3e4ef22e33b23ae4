"""Pipeline parallelism (`torch.distributed.pipelining`), alone or with DDP across pipelines.

The model is cut by layers into stages; each rank holds its stage(s) and passes activations
forward and gradients back to its neighbours, one micro-batch at a time, in the order a
schedule sets (GPipe, 1F1B, interleaved 1F1B). The ranks of one pipeline see the same batches:
the first stage feeds the inputs, the last computes the loss. "pp+ddp" runs several pipelines
side by side, each stage replicated across them, and DDP all-reduces each stage's gradients
once per optimizer step.

How the model is cut. A stage is a run of consecutive *units*: the model's top-level children,
in order, with any child named inside a split point opened into its own children (it must be
an nn.Sequential). The model's forward must therefore be its children applied in order, as an
nn.Sequential's is. Each stage is rebuilt as a tree that keeps its units at their original
paths, so parameter names (and checkpoints, which DCP keys by name) are the same as the whole
model's: a checkpoint written with one split loads into another.

Why "pp+ddp" and not "pp+fsdp": a stage already holds 1/p of the model, and pipelining runs a
backward per micro-batch; FSDP would gather every stage's parameters for each of them (or keep
them gathered, which is DDP's memory) and reduce-scatter once per step, DDP all-reduces once
per step with nothing gathered. torch's stages drive DDP's `no_sync` across micro-batches
themselves. With a model too large for one stage per GPU, FSDP under the pipeline is the next
step; it is not built here.

What a step measures (on each rank): the time its stages computed inside the schedule's runs and
the schedule's wall time, on one clock. The rest is waiting for neighbours, the bubble and the
transfers together: it is the step's exposed communication, and its share of the schedule's time
(the bubble fraction as pipeline papers define it), averaged over the ranks, is the metrics'
`pipeline_bubble_share`, within [0, 1] by construction.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradsync.errors import ConfigError, GradsyncError
from gradsync.comm.auto import auto_bucket_cap_mb
from gradsync.parallel.base import Placement, Strategy, average_gradients, scale_to_norm

# -- cutting the model ------------------------------------------------------------------------


def pipeline_units(model: nn.Module, split_points: tuple[str, ...] | None) -> list[list[str]]:
    """The unit paths of each stage, in forward order.

    Units are the model's top-level children; a child that a split point lies inside is
    replaced by its own children (it must be an nn.Sequential: only then is its forward its
    children in order). With no split points each top-level child is a stage.
    """
    if next(model.named_parameters(recurse=False), None) is not None or next(model.named_buffers(recurse=False), None) is not None:
        raise ConfigError(
            f"{type(model).__name__} holds parameters or buffers of its own, outside its children: its forward is "
            "more than its children applied in order, which a pipeline cuts. Move them into a child module "
            "(an nn.Sequential of the layers in order works)."
        )
    units = [name for name, _ in model.named_children()]
    if not units:
        raise ConfigError(f"{type(model).__name__} has no child modules to cut into pipeline stages.")
    if split_points is None:
        return [[unit] for unit in units]
    for point in split_points:
        while point not in units:
            parent = next((u for u in units if point.startswith(u + ".")), None)
            if parent is None:
                raise ConfigError(
                    f"parallel.split_points: {point!r} is not a module of the model in forward order (its units "
                    f"are {', '.join(units[:8])}{', ...' if len(units) > 8 else ''})."
                )
            container = model.get_submodule(parent)
            if not isinstance(container, nn.Sequential):
                raise ConfigError(
                    f"parallel.split_points: {point!r} lies inside {parent!r}, a {type(container).__name__}; a stage "
                    "can only begin inside an nn.Sequential, whose forward is its children in order. Split at "
                    f"{parent!r} or at a module path of the model's top level."
                )
            at = units.index(parent)
            units[at : at + 1] = [f"{parent}.{name}" for name, _ in container.named_children()]
    starts = [units.index(point) for point in split_points]
    if starts != sorted(set(starts)) or 0 in starts:
        raise ConfigError(
            f"parallel.split_points={split_points!r}: give each point once, in forward order, none at the very "
            "first module (the first stage begins there anyway)."
        )
    bounds = [0, *starts, len(units)]
    return [units[a:b] for a, b in zip(bounds, bounds[1:])]


class StageModule(nn.Module):
    """Some of the model's units, at their original paths, applied in order.

    The containers on the way to a unit are plain modules (they hold nothing else), so each
    parameter keeps its name in the whole model: `blocks.3.mlp.weight` stays that.
    """

    def __init__(self, model: nn.Module, units: list[str]) -> None:
        super().__init__()
        self.units = list(units)
        for path in units:
            *parents, leaf = path.split(".")
            holder: nn.Module = self
            for name in parents:
                if name not in holder._modules:
                    holder.add_module(name, nn.Module())
                holder = holder._modules[name]  # type: ignore[assignment]
            holder.add_module(leaf, model.get_submodule(path))

    def forward(self, *args: Any) -> Any:
        for path in self.units:
            out = self.get_submodule(path)(*args)
            args = out if isinstance(out, tuple) else (out,)
        return out


def _drop_units(model: nn.Module, keep: set[str], units: list[str]) -> None:
    """Free the units this rank does not hold from the user's model."""
    for path in units:
        if path in keep:
            continue
        *parents, leaf = path.split(".")
        holder = model.get_submodule(".".join(parents)) if parents else model
        holder._modules[leaf] = nn.Identity()


def split_batch(batch_len: int, microbatches: int, full: bool, multiple_of: int = 1) -> int:
    """How many equal micro-batches a batch of `batch_len` samples is cut into.

    torch's stages fix their buffers to the first micro-batch's shape, so the micro-batches of
    a step must be equal. A full batch takes the configured count, which must divide it; a
    shorter one (an epoch's last) the largest count up to that which divides it (a multiple of
    the pipeline's ranks for the interleaved schedule).
    """
    if full and batch_len % microbatches:
        raise ConfigError(
            f"a batch of {batch_len} samples does not split into parallel.microbatches={microbatches} equal "
            f"micro-batches; choose a batch_size that is a multiple of {microbatches}, or microbatches that divide it."
        )
    for count in range(min(microbatches, batch_len), 0, -1):
        if batch_len % count == 0 and count % multiple_of == 0:
            return count
    raise GradsyncError(
        f"a batch of {batch_len} sample(s) cannot be cut into equal micro-batches in rounds of {multiple_of} (the "
        "interleaved schedule's pipeline ranks); use prepare(..., remainder='drop') to leave the short last batch out."
    )


# -- the strategy ---------------------------------------------------------------------------------


@dataclass
class PipelineLayout:
    """Where this rank sits: which pipeline (its data-parallel index) and which place in it."""

    pp_size: int
    dp_size: int
    pp_rank: int
    dp_rank: int
    stages_per_rank: int

    @property
    def num_stages(self) -> int:
        return self.pp_size * self.stages_per_rank

    def stage_indexes(self) -> list[int]:
        """This rank's stages: pp_rank, pp_rank + pp_size, ... (the interleaved schedules' loop order)."""
        return [self.pp_rank + k * self.pp_size for k in range(self.stages_per_rank)]

    def ideal_bubble(self, microbatches: int) -> float:
        """The share of a step each rank idles in a perfectly balanced pipeline with free
        transfers: (p - 1) / (v*m + p - 1) for v stages per rank."""
        p, v = self.pp_size, self.stages_per_rank
        return (p - 1) / (v * microbatches + p - 1)


class PipelineStrategy(Strategy):
    """parallel="pp" and "pp+ddp"."""

    name = "pp"
    lockstep_forward = True  # a forward needs every stage of the pipeline
    staged = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        parallel = self.config.parallel
        world = self.dist.world_size
        pp_size = parallel.pp_size or world
        if world % pp_size:
            raise ConfigError(f"parallel.pp_size={pp_size} does not divide the world size {world}.")
        self.layout = PipelineLayout(pp_size, world // pp_size, pp_rank=self.dist.rank // (world // pp_size),
                                     dp_rank=self.dist.rank % (world // pp_size), stages_per_rank=parallel.stages_per_rank)
        self.microbatches = parallel.microbatches or 2 * pp_size
        if parallel.schedule == "interleaved-1f1b" and self.microbatches % pp_size:
            raise ConfigError(
                f"parallel.microbatches={self.microbatches}: the interleaved schedule runs micro-batches in rounds of "
                f"the pipeline's {pp_size} ranks; use a multiple of {pp_size}."
            )
        self.placement = Placement(self.layout.dp_rank, self.layout.dp_size, counts_samples=self.layout.pp_rank == 0)
        self.pp_group: Any = None
        self.dp_group: Any = None
        self.shard: StageModule | None = None  # every unit this rank holds (what the optimizer steps)
        self.stage_modules: list[StageModule] = []
        self.ddp_modules: list[DistributedDataParallel] = []
        # One schedule per batch size: torch's stages fix their buffers to the first micro-batch's
        # shapes, and an epoch's short last batch has other ones.
        self._schedules: dict[int, tuple[Any, list[Any]]] = {}
        self._loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
        self._loss_weight = 1.0
        self._batch_len = 1
        self._loss_scale: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._raw_losses: list[tuple[torch.Tensor, int]] = []
        # Running totals (a step's are differences): seconds computing, seconds in the schedule, bytes sent.
        self._compute_s = 0.0  # counted only inside the schedule's runs: it is a part of _schedule_s
        self._schedule_s = 0.0
        self._scheduling = False  # a schedule's run is under way (the stages' compute counts)
        self._p2p_bytes = 0.0
        self._all_reduce_bytes = 0.0  # "pp+ddp": each stage's gradient all-reduces across pipelines
        self._idle_s_last = 0.0
        self._reductions = 0  # gradient reductions across pipelines ("pp+ddp")
        self._synced = True  # whether the micro-step running reduces (its window's last)

    # -- wrapping ------------------------------------------------------------------------------

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh

        layout = self.layout
        stage_units = pipeline_units(model, self.config.parallel.split_points)
        if len(stage_units) != layout.num_stages:
            raise ConfigError(
                f"the model cuts into {len(stage_units)} stage(s) but the pipeline has {layout.num_stages} "
                f"({layout.pp_size} ranks x {layout.stages_per_rank} per rank); "
                + ("give parallel.split_points, one fewer than the stages." if self.config.parallel.split_points is None
                   else f"give {layout.num_stages - 1} split point(s).")
            )
        mesh = init_device_mesh(self.dist.device.type, (layout.pp_size, layout.dp_size), mesh_dim_names=("pp", "dp"))
        self.pp_group, self.dp_group = mesh.get_group("pp"), mesh.get_group("dp")
        self.placement.data_group = self.dp_group
        mine = layout.stage_indexes()
        held = [path for index in mine for path in stage_units[index]]
        self.shard = StageModule(model, held)
        _drop_units(model, set(held), [p for units in stage_units for p in units])
        self.stage_modules = [StageModule(self.shard, stage_units[index]) for index in mine]
        if self.name == "pp+ddp" and layout.dp_size > 1:
            device = self.dist.device
            self.ddp_modules = [
                DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None,
                                        process_group=self.dp_group, bucket_cap_mb=self._bucket_cap_mb(module))
                for module in self.stage_modules
            ]
        self.logger.info(
            f"pp: stage(s) {', '.join(map(str, mine))} of {layout.num_stages} on this rank "
            f"({', '.join(self.stage_modules[0].units[:3])}{', ...' if len(self.stage_modules[0].units) > 3 else ''}); "
            f"{layout.pp_size} ranks per pipeline, {layout.dp_size} pipeline(s); schedule {self.config.parallel.schedule}, "
            f"{self.microbatches} micro-batches a batch (ideal bubble {100 * layout.ideal_bubble(self.microbatches):.0f}%)"
        )
        return PipelinedModel(self)

    def _schedule_for(self, batch_len: int) -> tuple[Any, list[Any]]:
        """The schedule and its stages for batches of `batch_len` samples (built on first use)."""
        if batch_len in self._schedules:
            return self._schedules[batch_len]
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        layout = self.layout
        microbatches = self.microbatches_for(batch_len)
        submodules: list[nn.Module] = list(self.ddp_modules or self.stage_modules)
        stages = [
            PipelineStage(module, index, layout.num_stages, self.dist.device, group=self.pp_group)
            for module, index in zip(submodules, layout.stage_indexes())
        ]
        for stage in stages:
            self._meter(stage)
        # Gradients are scaled through the loss (scale_grads=False): the trainer's weight for the
        # window and fp16's loss scale go into it, and gradients accumulated by an earlier
        # schedule step of the same window are not divided again.
        if self.config.parallel.schedule == "interleaved-1f1b":
            schedule = ScheduleInterleaved1F1B(stages, microbatches, loss_fn=self._scaled_loss, scale_grads=False)
        else:
            kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[self.config.parallel.schedule]
            if microbatches < layout.num_stages:
                # 1F1B needs a micro-batch per stage; a short last batch may have fewer. GPipe
                # runs them in the same order, so the gradients are the same.
                kind = ScheduleGPipe
            schedule = kind(stages[0], microbatches, loss_fn=self._scaled_loss, scale_grads=False)
        self._schedules[batch_len] = (schedule, stages)
        return schedule, stages

    def microbatches_for(self, batch_len: int) -> int:
        """Micro-batches for a batch of `batch_len` samples (see `split_batch`); the first
        batch is the loader's full size, which must divide into a configured count."""
        # Only a count the user chose is held to; the default (twice the pipeline's ranks) is a target.
        full = not self._schedules and self.config.parallel.microbatches is not None
        return split_batch(batch_len, self.microbatches, full=full,
                           multiple_of=self.layout.pp_size if self.config.parallel.schedule == "interleaved-1f1b" else 1)

    def _bucket_cap_mb(self, stage: nn.Module) -> float:
        """ddp.bucket_cap_mb for a stage's DDP; "auto" sizes it from the stage's gradients, as under DDP."""
        cap = self.config.ddp.bucket_cap_mb
        return auto_bucket_cap_mb(stage) if cap == "auto" else float(cap)

    def _meter(self, stage: Any) -> None:
        """Time this stage's compute and count the bytes it sends (our own stage objects only)."""
        strategy = self

        def timed(method: Callable[..., Any]) -> Callable[..., Any]:
            def run(*args: Any, **kwargs: Any) -> Any:
                started = time.perf_counter()
                try:
                    return method(*args, **kwargs)
                finally:
                    if strategy._scheduling:  # nested in the schedule's run, on its clock: never more than it
                        strategy._compute_s += time.perf_counter() - started
            return run

        def counted(method: Callable[..., Any]) -> Callable[..., Any]:
            def ops(*args: Any, **kwargs: Any) -> Any:
                result = method(*args, **kwargs)
                for op in result:
                    strategy._p2p_bytes += op.tensor.numel() * op.tensor.element_size()
                return result
            return ops

        stage.forward_one_chunk = timed(stage.forward_one_chunk)
        stage.backward_one_chunk = timed(stage.backward_one_chunk)
        stage.get_fwd_send_ops = counted(stage.get_fwd_send_ops)
        stage.get_bwd_send_ops = counted(stage.get_bwd_send_ops)

    def trained_module(self, model: nn.Module) -> nn.Module:
        assert self.shard is not None
        return self.shard

    @property
    def is_first(self) -> bool:
        return 0 in self.layout.stage_indexes()

    @property
    def is_last(self) -> bool:
        return self.layout.num_stages - 1 in self.layout.stage_indexes()

    def _global_rank(self, pp_rank: int) -> int:
        return dist.get_global_rank(self.pp_group, pp_rank)

    # -- a micro-step ------------------------------------------------------------------------------

    def micro_step(self, synced: bool) -> ContextManager[None]:
        self._synced = synced
        return self._without_ddp() if not synced and self.ddp_modules else contextlib.nullcontext()

    @property
    def reductions(self) -> int:
        return self._reductions

    @contextlib.contextmanager
    def _without_ddp(self) -> Iterator[None]:
        """An accumulating micro-step's schedule runs the bare stages: torch's stages reduce
        through DDP at every schedule's last backward, which only the window's last should."""
        stages = [stage for _, built in self._schedules.values() for stage in built]
        bare = dict(zip(map(id, self.ddp_modules), self.stage_modules))
        for stage in stages:
            stage.submod = bare[id(stage.submod)]
        try:
            yield
        finally:
            wrapped = dict(zip(map(id, self.stage_modules), self.ddp_modules))
            for stage in stages:
                stage.submod = wrapped[id(stage.submod)]

    def forward_backward(self, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor], weight: float,
                         loss_scale: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
        """Run the schedule over one batch; the mean loss over its micro-batches, on every rank of the pipeline."""
        self._batch_len = len(targets)
        self._loss_fn, self._loss_weight, self._loss_scale = loss_fn, weight, loss_scale
        self._raw_losses = []
        schedule, _ = self._schedule_for(self._batch_len)
        compute_before = self._compute_s
        args = (inputs if isinstance(inputs, tuple) else (inputs,)) if self.is_first else ()
        self._scheduling = True
        started = time.perf_counter()
        try:
            schedule.step(*args, target=targets if self.is_last else None)
        finally:
            self._scheduling = False
        if self._synced and self.ddp_modules:
            self._reductions += 1  # the schedule's last backward all-reduced each stage's gradients
            self._all_reduce_bytes += self._gradient_bytes()
        wall = time.perf_counter() - started
        self._schedule_s += wall
        self._idle_s_last += max(0.0, wall - (self._compute_s - compute_before))
        # In float64, so that every rank allocates the same dtype to receive it whatever the model's.
        loss = (sum(raw.double() * n for raw, n in self._raw_losses) / self._batch_len) if self._raw_losses \
            else torch.zeros((), dtype=torch.float64, device=self.dist.device)
        if self.layout.pp_size > 1:
            dist.broadcast(loss, src=self._global_rank(self.layout.pp_size - 1), group=self.pp_group)
        return loss

    def _scaled_loss(self, output: Any, target: Any) -> torch.Tensor:
        assert self._loss_fn is not None
        raw = self._loss_fn(output, target)
        if not isinstance(raw, torch.Tensor) or raw.numel() != 1:
            raise GradsyncError("the loss_fn given to step.forward_backward() must return a scalar tensor (a mean over the micro-batch).")
        samples = len(target)
        self._raw_losses.append((raw.detach(), samples))
        # The batch's mean loss (micro-batches may differ in size by one), weighted as the trainer
        # weighs this batch in its window.
        scaled = raw * (self._loss_weight * samples / self._batch_len)
        return self._loss_scale(scaled) if self._loss_scale is not None else scaled

    def exposed_estimate_s(self) -> float:
        idle, self._idle_s_last = self._idle_s_last, 0.0
        return idle

    def comm_counters(self) -> dict[str, float]:
        total = self._p2p_bytes + self._all_reduce_bytes
        return {"raw_bytes": total, "sent_bytes": total, "p2p_bytes": self._p2p_bytes,
                **({"all_reduce_bytes": self._all_reduce_bytes} if self.ddp_modules else {}),
                "pipeline_compute_s": self._compute_s, "pipeline_schedule_s": self._schedule_s}

    # -- the update ----------------------------------------------------------------------------------

    def clip_grad_norm(self, parameters: list[nn.Parameter], max_norm: float) -> float:
        """The norm over the whole model: each rank's stages' squares summed over the pipeline
        (the copies across pipelines hold the same, reduced gradients)."""
        grads = [p.grad for p in parameters if p.grad is not None]
        local = nn.utils.get_total_norm(grads, 2.0) if grads else torch.zeros((), device=self.dist.device)
        squares = (local.double() ** 2).reshape(1)
        if self.layout.pp_size > 1:
            dist.all_reduce(squares, group=self.pp_group)
        total = math.sqrt(float(squares))
        scale_to_norm(grads, total, max_norm)
        return total

    def reduce_unsynced(self) -> bool:
        """The window's boundary batch was skipped: average the stages' gradients across pipelines by hand."""
        if self.layout.dp_size == 1 or self.shard is None:
            return False
        average_gradients([p for p in self.shard.parameters() if p.requires_grad], self.dp_group, self.layout.dp_size)
        self._reductions += 1
        self._all_reduce_bytes += self._gradient_bytes()
        return True

    def _gradient_bytes(self) -> int:
        """The bytes one all-reduce of this rank's stage gradients carries (nccl-tests' size)."""
        assert self.shard is not None
        return sum(p.numel() * p.element_size() for p in self.shard.parameters() if p.requires_grad)

    def describe(self) -> dict[str, Any]:
        layout = self.layout
        return {"strategy": self.name, "pp_size": layout.pp_size, "dp_size": layout.dp_size,
                "stages": layout.num_stages, "schedule": self.config.parallel.schedule,
                "microbatches": self.microbatches, "ideal_bubble": round(layout.ideal_bubble(self.microbatches), 4)}


class PipelineDDPStrategy(PipelineStrategy):
    name = "pp+ddp"


# -- what the loop calls ------------------------------------------------------------------------------


class PipelinedModel(nn.Module):
    """What prepare() returns under a pipeline: train with `step.forward_backward(inputs,
    targets, loss_fn)`; call it (under torch.no_grad()) for outputs, which every rank of the
    pipeline gets. The parameters it lists are this rank's stages'."""

    def __init__(self, strategy: PipelineStrategy) -> None:
        super().__init__()
        self._strategy = strategy
        assert strategy.shard is not None
        self.shard = strategy.shard

    def forward(self, *inputs: Any) -> Any:
        if torch.is_grad_enabled():
            raise GradsyncError(
                "under parallel='pp' the model is spread over the pipeline's ranks: train with "
                "`loss = step.forward_backward(inputs, targets, loss_fn)` inside `with trainer.step() as step:`, "
                "and call the model only under torch.no_grad() (evaluation), where every rank gets the outputs."
            )
        return relay_forward(self._strategy, inputs)


def relay_forward(strategy: PipelineStrategy, inputs: tuple[Any, ...]) -> torch.Tensor:
    """A forward-only pass of a whole batch through every stage in order, the output then sent
    to every rank of the pipeline. Evaluation batches may differ in size from training's
    micro-batches, which the schedule's stages have fixed their buffers to, so this passes
    activations directly: shape first, then the tensor."""
    layout, group = strategy.layout, strategy.pp_group
    device = strategy.dist.device
    held = dict(zip(layout.stage_indexes(), strategy.stage_modules))
    current: Any = inputs[0] if len(inputs) == 1 else inputs
    for index in range(layout.num_stages):
        owner = index % layout.pp_size
        if owner == layout.pp_rank:
            if index > 0 and (index - 1) % layout.pp_size != layout.pp_rank:
                current = _receive(strategy._global_rank((index - 1) % layout.pp_size), group, device)
            current = held[index](current)
            if index + 1 < layout.num_stages and (index + 1) % layout.pp_size != layout.pp_rank:
                _send(current, strategy._global_rank((index + 1) % layout.pp_size), group, device)
    if layout.pp_size == 1:
        return current
    last = strategy._global_rank((layout.num_stages - 1) % layout.pp_size)
    return _broadcast(current if dist.get_rank() == last else None, last, group, device)


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool, torch.uint8]


def _header(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.tensor([_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape, *[0] * (8 - tensor.dim())],
                        dtype=torch.int64, device=device)


def _empty_from(header: torch.Tensor, device: torch.device) -> torch.Tensor:
    values = header.tolist()
    return torch.empty(values[2 : 2 + values[1]], dtype=_DTYPES[values[0]], device=device)


def _send(tensor: torch.Tensor, to: int, group: Any, device: torch.device) -> None:
    dist.send(_header(tensor, device), dst=to, group=group)
    dist.send(tensor.contiguous(), dst=to, group=group)


def _receive(source: int, group: Any, device: torch.device) -> torch.Tensor:
    header = torch.empty(10, dtype=torch.int64, device=device)
    dist.recv(header, src=source, group=group)
    tensor = _empty_from(header, device)
    dist.recv(tensor, src=source, group=group)
    return tensor


def _broadcast(tensor: torch.Tensor | None, source: int, group: Any, device: torch.device) -> torch.Tensor:
    header = _header(tensor, device) if tensor is not None else torch.empty(10, dtype=torch.int64, device=device)
    dist.broadcast(header, src=source, group=group)
    out = tensor.contiguous() if tensor is not None else _empty_from(header, device)
    dist.broadcast(out, src=source, group=group)
    return out
