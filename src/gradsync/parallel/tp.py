"""Tensor parallelism (`parallelize_module` over a `DeviceMesh`), alone or under FSDP.

A tensor-parallel group splits each large matmul: a column-wise layer keeps a slice of the
output features, the row-wise layer after it a slice of its input features and all-reduces
the result. The ranks of a group therefore compute one copy of the model together: they see
the same batches and draw the same random numbers, and only groups are data-parallel peers.
With "fsdp+tp" the mesh is (dp, tp): FSDP shards across groups, tensor parallelism within.

The standard plan, applied to blocks it recognises by their Linear layers' names: attention
q/k/v and MLP up/gate column-wise, attention output and MLP down row-wise. Attention that
splits heads with the model's head count would see only its share of the features; split
with `view(batch, length, -1, head_dim)` so each rank takes its local heads.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
import re
from typing import Any, ContextManager, Iterator

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from gradsync.errors import ConfigError
from gradsync.metrics import Clock
from gradsync.parallel.base import CommTally, Placement, Strategy, clip_dtensor_aware, tally_counters
from gradsync.parallel.fsdp import FSDPStrategy

# Leaf names of Linear layers in the common transformer code bases (nanoGPT, Llama, HF, torchtitan).
COLWISE_NAMES = frozenset({"q", "k", "v", "q_proj", "k_proj", "v_proj", "query", "key", "value", "wq", "wk", "wv",
                           "up", "up_proj", "gate", "gate_proj", "fc1", "c_fc", "w1", "w3"})
ROWWISE_NAMES = frozenset({"o", "o_proj", "out", "out_proj", "proj", "wo", "down", "down_proj", "fc2", "c_proj", "w2"})


def standard_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """Column-wise then row-wise pairs: in each module whose Linear children include both a
    column-wise name and a row-wise one (an attention, an MLP), those children."""
    plan: dict[str, ParallelStyle] = {}
    for path, module in model.named_modules():
        linears = {name: child for name, child in module.named_children() if isinstance(child, nn.Linear)}
        columns = [name for name in linears if name in COLWISE_NAMES]
        rows = [name for name in linears if name in ROWWISE_NAMES]
        if columns and len(rows) == 1:
            prefix = f"{path}." if path else ""
            plan.update({prefix + name: ColwiseParallel() for name in columns})
            plan[prefix + rows[0]] = RowwiseParallel()
    return plan


def resolve_plan(model: nn.Module, given: Any) -> dict[str, ParallelStyle]:
    """The user's plan with patterns expanded to module paths and styles built, or the standard plan."""
    if given is None:
        plan = standard_plan(model)
        if not plan:
            raise ConfigError(
                "parallel tensor plan: no attention or MLP was recognised (gradsync looks for Linear layers named "
                f"{', '.join(sorted(COLWISE_NAMES)[:6])}, ... beside one named {', '.join(sorted(ROWWISE_NAMES)[:6])}, ...). "
                "Give parallel.tp_plan, e.g. {'blocks.*.mlp.up': 'colwise', 'blocks.*.mlp.down': 'rowwise'}."
            )
        return plan
    paths = [name for name, _ in model.named_modules() if name]
    plan = {}
    for pattern, style in given.items():
        matched = [path for path in paths if fnmatch.fnmatchcase(path, pattern)]
        if not matched:
            raise ConfigError(f"parallel.tp_plan[{pattern!r}] matches no module of the model (e.g. {', '.join(paths[:5])}).")
        for path in matched:
            plan[path] = ColwiseParallel() if style == "colwise" else RowwiseParallel() if style == "rowwise" else style
    return plan


class ExchangeMeter(TorchDispatchMode):
    """Tensor parallelism's activation exchanges, counted and timed during forward and backward.

    DTensor issues them as functional collectives (`_c10d_functional.all_reduce`, ...), which
    return at once; training blocks where the result is first used: in `wait_tensor`, or in
    the first op that reads an `AsyncCollectiveTensor`. Those intervals are the exposed
    communication. A dispatch mode sees every op, which costs Python per op (about 8% of a
    small model's step on the CPU, `make bench-tp-meter`): `SampledExchanges` runs it on a
    sample of the steps.
    """

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock
        self.kinds = {"all_reduce": CommTally(), "all_gather": CommTally(), "reduce_scatter": CommTally()}
        self.waits: list[tuple[Any, Any]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace == "_c10d_functional":
            name = func._opname
            if name == "wait_tensor":
                return self._blocking(func, args, kwargs)
            self._count(name, args)
            return func(*args, **kwargs)
        if any(isinstance(a, AsyncCollectiveTensor) for a in args):
            return self._blocking(func, args, kwargs)
        return func(*args, **kwargs)

    def _blocking(self, func: Any, args: tuple, kwargs: dict) -> Any:
        start = self.clock.mark()
        result = func(*args, **kwargs)
        self.waits.append((start, self.clock.mark()))
        return result

    def _count(self, name: str, args: tuple) -> None:
        tensor = args[0]
        if not isinstance(tensor, torch.Tensor):
            return
        nbytes = tensor.numel() * tensor.element_size()
        if name.startswith("all_reduce"):
            kind, moved = "all_reduce", nbytes  # the payload, as DDP's buckets are counted
        elif name.startswith("all_gather_into_tensor"):
            kind, moved = "all_gather", nbytes * args[1]  # the gathered output, as nccl-tests sizes it
        elif name.startswith("reduce_scatter_tensor"):
            kind, moved = "reduce_scatter", nbytes  # the input, as nccl-tests sizes it
        else:
            return
        self.kinds[kind].bytes += moved
        self.kinds[kind].calls += 1

    def take_spans(self) -> list[tuple[Any, Any]]:
        spans, self.waits = self.waits, []
        return spans


METERED_FIRST_STEPS = 4  # tensor-parallel steps metered from the start (their shapes settle)
METERED_EVERY = 10  # then one step in this many


class SampledExchanges:
    """The exchange meter on the first steps and then one step in METERED_EVERY; a step between
    carries the last metered step's bytes and exposed seconds as estimates.

    A step's exchanges repeat step after step (the same layers, batch shapes and plan), so the
    sample describes the others well, for a fraction of the meter's cost.
    """

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.meter = ExchangeMeter(clock)
        self.metering = True
        self._bytes_at_start: dict[str, float] = {}
        self._last_bytes: dict[str, float] = {}
        self._last_seconds = 0.0
        self._estimated = {kind: CommTally() for kind in self.meter.kinds}

    def start_window(self, step: int) -> None:
        self.meter.take_spans()  # not this step's
        self.metering = step <= METERED_FIRST_STEPS or step % METERED_EVERY == 0
        self._bytes_at_start = {kind: tally.bytes for kind, tally in self.meter.kinds.items()}

    def micro_step(self) -> ContextManager[Any]:
        return self.meter if self.metering else contextlib.nullcontext()

    def take_exposed(self) -> list[tuple[Any, Any]]:
        spans = self.meter.take_spans()
        if self.metering:
            self._last_seconds = sum(self.clock.seconds(a, b) for a, b in spans)
            self._last_bytes = {kind: tally.bytes - self._bytes_at_start.get(kind, 0.0) for kind, tally in self.meter.kinds.items()}
        return spans

    def exposed_estimate_s(self) -> float:
        if self.metering:
            return 0.0
        for kind, moved in self._last_bytes.items():
            self._estimated[kind].bytes += moved
        return self._last_seconds

    def counters(self) -> dict[str, float]:
        return tally_counters({kind: CommTally(bytes=tally.bytes + self._estimated[kind].bytes)
                               for kind, tally in self.meter.kinds.items()})


_VIEW_SIZE = re.compile(r"shape '\[([-\d, ]+)\]' is invalid for input of size (\d+)")


def explain_head_split(error: BaseException, size: int) -> Exception | None:
    """A reshape that asked for `size` times the elements it got: a model splitting heads with
    its full head count while a column-wise layer gave it 1/size of the features."""
    match = _VIEW_SIZE.search(str(error)) if isinstance(error, RuntimeError) and size > 1 else None
    if match is None:
        return None
    dims = [int(d) for d in match[1].split(",")]
    wanted = math.prod(d for d in dims if d != -1)
    if -1 in dims or wanted != size * int(match[2]):
        return None
    return ConfigError(
        f"a reshape to {dims} got {match[2]} elements, 1/{size} of what it asked for: under tensor parallelism over "
        f"{size} ranks, a column-wise layer leaves each rank 1/{size} of its output features (its share of the heads). "
        "Split heads with -1 for their count, e.g. q.view(batch, length, -1, head_dim), or give parallel.tp_plan "
        "without that layer."
    )


def tp_size(strategy: str, world: int, given: int | None) -> int:
    size = given or world
    if world % size:
        raise ConfigError(f"parallel.tp_size={size} does not divide the world size {world}.")
    if strategy == "tp" and size != world:
        raise ConfigError(
            f"parallel='tp' with tp_size={size} of {world} ranks would leave {world // size} copies whose gradients "
            "nothing reduces; use parallel={'strategy': 'fsdp+tp', 'tp_size': %d} for data parallelism across them." % size
        )
    return size


class TPStrategy(Strategy):
    """`parallel="tp"`: one copy of the model over every rank; nothing to reduce between copies."""

    name = "tp"
    sharded = True
    lockstep_forward = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        tp_size(self.name, self.dist.world_size, self.config.parallel.tp_size)
        self.placement = Placement(data_rank=0, data_world_size=1, counts_samples=self.dist.rank == 0)
        self.mesh: DeviceMesh | None = None
        self.plan: dict[str, ParallelStyle] = {}
        self.exchanges = SampledExchanges(self.clock)

    def wrap(self, model: nn.Module) -> nn.Module:
        self.mesh = init_device_mesh(self.dist.device.type, (self.dist.world_size,), mesh_dim_names=("tp",))
        self.plan = _parallelize(model, self.mesh, self.config.parallel.tp_plan, self.logger if self.dist.is_main else None)
        return model

    def start_window(self, step: int) -> None:
        self.exchanges.start_window(step)

    def micro_step(self, synced: bool) -> ContextManager[Any]:
        return self.exchanges.micro_step()  # metered from the forward to the end of the backward

    def comm_counters(self) -> dict[str, float]:
        return self.exchanges.counters()

    def take_exposed(self) -> list[tuple[Any, Any]]:
        return self.exchanges.take_exposed()

    def exposed_estimate_s(self) -> float:
        return self.exchanges.exposed_estimate_s()

    def clip_grad_norm(self, parameters: list[nn.Parameter], max_norm: float) -> float:
        return clip_dtensor_aware(parameters, max_norm)

    def explain(self, error: BaseException) -> Exception | None:
        return explain_head_split(error, self.dist.world_size)

    def describe(self) -> dict[str, Any]:
        return {"strategy": self.name, "mesh": {"tp": self.dist.world_size}, "tp_layers": len(self.plan)}


class FSDPTPStrategy(FSDPStrategy):
    """`parallel="fsdp+tp"`: a (dp, tp) mesh, tensor parallel within rows, FSDP across them."""

    name = "fsdp+tp"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        world = self.dist.world_size
        self.tp_size = tp_size(self.name, world, self.config.parallel.tp_size)
        # Ranks r*tp .. r*tp+tp-1 form a tensor-parallel group (neighbours: one node's fast links).
        self.placement = Placement(data_rank=self.dist.rank // self.tp_size, data_world_size=world // self.tp_size,
                                   counts_samples=self.dist.rank % self.tp_size == 0)
        self.plan: dict[str, ParallelStyle] = {}
        self.exchanges = SampledExchanges(self.clock)

    def wrap(self, model: nn.Module) -> nn.Module:
        world = self.dist.world_size
        self.mesh = init_device_mesh(self.dist.device.type, (world // self.tp_size, self.tp_size), mesh_dim_names=("dp", "tp"))
        self.placement.data_group = self.mesh["dp"].get_group()
        self.plan = _parallelize(model, self.mesh["tp"], self.config.parallel.tp_plan, self.logger if self.dist.is_main else None)
        self._shard(model, self.mesh["dp"])
        return model

    def start_window(self, step: int) -> None:
        self.meter.take_spans()  # FSDP's waits since the last step are not this step's
        self.exchanges.start_window(step)

    @contextlib.contextmanager
    def _metered_micro_step(self, synced: bool) -> Iterator[None]:
        with super().micro_step(synced), self.exchanges.micro_step():
            yield

    def micro_step(self, synced: bool) -> ContextManager[None]:
        return self._metered_micro_step(synced)

    def comm_counters(self) -> dict[str, float]:
        fsdp, exchanges = super().comm_counters(), self.exchanges.counters()
        return {key: fsdp.get(key, 0) + exchanges.get(key, 0) for key in fsdp.keys() | exchanges.keys()}

    def take_exposed(self) -> list[tuple[Any, Any]]:
        return super().take_exposed() + self.exchanges.take_exposed()

    def exposed_estimate_s(self) -> float:
        return self.exchanges.exposed_estimate_s()

    def explain(self, error: BaseException) -> Exception | None:
        return explain_head_split(error, self.tp_size)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "tp_layers": len(self.plan)}


def _parallelize(model: nn.Module, mesh: DeviceMesh, given: Any, logger: Any) -> dict[str, ParallelStyle]:
    plan = resolve_plan(model, given)
    parallelize_module(model, mesh, plan)
    if logger is not None:
        shown = ", ".join(f"{path}={type(style).__name__.removesuffix('Parallel').lower()}" for path, style in list(plan.items())[:4])
        logger.info(f"tensor parallel over {mesh.size()} ranks: {len(plan)} layers ({shown}{', ...' if len(plan) > 4 else ''})")
    return plan
