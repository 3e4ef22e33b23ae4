"""FSDP2 (`fully_shard`) and HSDP: parameters, gradients and optimizer state sharded over ranks.

Each FSDP unit (a transformer block, by default every submodule class that repeats) gathers
its parameters just before its forward and backward and reduce-scatters its gradients right
after its backward, so communication overlaps the neighbouring units' compute. HSDP shards
within groups of ranks (a node) and all-reduces the shards across groups.

The strategy owns: choosing the units, the mesh, the mixed-precision policy, accumulation
without reduction (`set_requires_gradient_sync(False)` on every micro-batch but a window's
last), reducing a window whose boundary batch was skipped, and metering every all-gather,
reduce-scatter and HSDP all-reduce through FSDP's own communication hooks.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from typing import Any, ContextManager, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from gradsync import compat
from gradsync.errors import ConfigError, GradsyncError
from gradsync.metrics import Clock, StepRecord
from gradsync.parallel.base import CommTally, Strategy, clip_dtensor_aware, tally_counters


class CommMeter:
    """FSDP's all-gathers and reduce-scatters, counted and timed as they are issued.

    Bytes are counted as nccl-tests sizes each collective (an all-gather's output, a
    reduce-scatter's input, an all-reduce's buffer), as DDP's all-reduced buckets are: what a
    rank sends over its links is that times (n-1)/n, (n-1)/n and 2(n-1)/n for a group of n.

    On the CPU (Gloo) FSDP waits for each collective where it issues it, so a collective's
    interval is time training waited: exposed communication. On CUDA the marks are events on
    FSDP's communication streams, so the intervals are the collectives' own durations, an
    upper bound on what compute did not hide.
    """

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.kinds = {"all_gather": CommTally(), "reduce_scatter": CommTally(), "all_reduce": CommTally()}
        self._reduce_scatter_end: Any = None

    def timed(self, kind: str, nbytes: int, call: Any) -> Any:
        tally = self.kinds[kind]
        start = self.clock.mark()
        result = call()  # Gloo and FSDP's CUDA streams issue it synchronously (FSDP's default)
        end = self.clock.mark()
        tally.bytes += nbytes
        tally.calls += 1
        tally.spans.append((start, end))
        if kind == "reduce_scatter":
            self._reduce_scatter_end = end
        return result

    def all_reduced(self, output: torch.Tensor) -> None:
        """HSDP's all-reduce across replicas, seen from the hook FSDP calls right after it: it
        ran from the end of the unit's reduce-scatter to now."""
        tally = self.kinds["all_reduce"]
        tally.bytes += output.numel() * output.element_size()
        tally.calls += 1
        if self._reduce_scatter_end is not None:
            tally.spans.append((self._reduce_scatter_end, self.clock.mark()))

    def take_spans(self) -> list[tuple[Any, Any]]:
        spans = [span for tally in self.kinds.values() for span in tally.spans]
        for tally in self.kinds.values():
            tally.spans = []
        return spans


class _MeteredAllGather(AllGather):
    def __init__(self, meter: CommMeter) -> None:
        self.meter = meter

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False) -> Any:
        # Counted as nccl-tests sizes an all-gather: the gathered buffer (a rank receives (n-1)/n of it).
        nbytes = output_tensor.numel() * output_tensor.element_size()
        return self.meter.timed(
            "all_gather", nbytes,
            lambda: dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op),
        )


class _MeteredReduceScatter(ReduceScatter):
    def __init__(self, meter: CommMeter) -> None:
        self.meter = meter

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False) -> Any:
        # Counted as nccl-tests sizes a reduce-scatter: the whole gradient buffer (a rank sends (n-1)/n of it).
        nbytes = input_tensor.numel() * input_tensor.element_size()
        return self.meter.timed(
            "reduce_scatter", nbytes,
            lambda: dist.reduce_scatter_single(output=output_tensor, input=input_tensor, group=group, op=op, async_op=async_op),
        )


def repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost submodules whose class occurs more than once among the outermost ones and
    holds parameters: a transformer's blocks, a ResNet's residual blocks, an MLP's Linear layers.

    Containers (Sequential, ModuleList, ModuleDict) are looked through, not taken; a class seen
    once outside the blocks (a final LayerNorm whose class the blocks also use) is not a block.
    """
    containers = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
    counts = Counter(type(m) for name, m in model.named_modules()
                     if name and not isinstance(m, containers) and any(True for _ in m.parameters()))
    outermost: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not name or isinstance(module, containers) or counts[type(module)] < 2:
            continue
        if any(name.startswith(parent + ".") for parent, _ in outermost):
            continue  # inside a block already taken
        outermost.append((name, module))
    kept = Counter(type(m) for _, m in outermost)
    return [(name, module) for name, module in outermost if kept[type(module)] >= 2]


def block_sized_leftovers(model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The outermost modules outside the blocks holding at least as many parameters as an
    average block (a transformer's embedding and output head): left in the root, they would be
    gathered with it for the whole forward and backward, so they become units of their own."""
    if not blocks:
        return []
    inside = {id(p) for _, block in blocks for p in block.parameters()}
    average = sum(p.numel() for _, block in blocks for p in block.parameters()) / len(blocks)
    chosen: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not name or any(name == parent or name.startswith(parent + ".") for parent, _ in blocks + chosen):
            continue
        own = list(module.parameters())
        if any(id(p) in inside for p in own):
            continue  # holds blocks (a ModuleList of them)
        if sum(p.numel() for p in own) >= average:
            chosen.append((name, module))
    return chosen


def named_blocks(model: nn.Module, blocks: tuple[Any, ...]) -> list[tuple[str, nn.Module]]:
    """The submodules of the classes `blocks` names (outermost ones), or a ConfigError naming
    the classes the model has."""
    wanted = {b if isinstance(b, str) else b.__name__ for b in blocks}
    found = [(n, m) for n, m in model.named_modules() if n and type(m).__name__ in wanted]
    missing = wanted - {type(m).__name__ for _, m in found}
    if missing:
        classes = sorted({type(m).__name__ for n, m in model.named_modules() if n})
        raise ConfigError(
            f"parallel.blocks names {', '.join(sorted(missing))}, which the model does not contain; "
            f"its module classes are: {', '.join(classes)}."
        )
    outermost: list[tuple[str, nn.Module]] = []
    for name, module in found:
        if not any(name.startswith(parent + ".") for parent, _ in outermost):
            outermost.append((name, module))
    return outermost


def mixed_precision_policy(precision: str, compression: str) -> MixedPrecisionPolicy:
    """precision "bf16": compute (and gather) in bf16, reduce in fp32 unless compression asks
    for bf16 gradients, as DDP's bf16 compression would send them."""
    param_dtype = torch.bfloat16 if precision == "bf16" else None
    reduce_dtype = torch.bfloat16 if compression == "bf16" else (torch.float32 if param_dtype is not None else None)
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


class FSDPStrategy(Strategy):
    """`parallel="fsdp"` and `"hsdp"` (and the FSDP part of `"fsdp+tp"`, see gradsync.parallel.tp)."""

    name = "fsdp"
    sharded = True
    lockstep_forward = True
    autocast = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.meter = CommMeter(self.clock)
        self.units: list[str] = []  # module paths sharded as FSDP units ("" is the root)
        self.mesh: DeviceMesh | None = None
        self._fsdp_modules: list[FSDPModule] = []
        self._root: FSDPModule | None = None
        self._reductions = 0
        self._mesh_shape = self.mesh_shape()  # checked here, before any rank builds a mesh

    def mesh_shape(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The mesh FSDP shards over: every rank, or HSDP's (replicate, shard) 2-D mesh."""
        world, parallel = self.dist.world_size, self.config.parallel
        if self.name != "hsdp":
            return (world,), ("shard",)
        shard = parallel.shard_size or int(_local_world_size() or world)
        if world % shard or (shard == world and parallel.shard_size is None):
            raise ConfigError(
                f"parallel='hsdp' with {world} ranks: "
                + (f"shard_size={shard} does not divide the world size." if world % shard else
                   "every rank is on one node, so sharding within a node is plain FSDP. Give parallel.shard_size "
                   f"(a divisor of {world}) to replicate across groups of that size, or use parallel='fsdp'.")
            )
        return (world // shard, shard), ("replicate", "shard")

    def wrap(self, model: nn.Module) -> nn.Module:
        shape, names = self._mesh_shape
        self.mesh = init_device_mesh(self.dist.device.type, shape, mesh_dim_names=names)
        self._shard(model, self.mesh)
        return model

    def _shard(self, model: nn.Module, mesh: DeviceMesh) -> None:
        parallel = self.config.parallel
        if parallel.blocks:
            blocks = named_blocks(model, parallel.blocks)
        else:
            blocks = repeated_blocks(model)
            blocks += block_sized_leftovers(model, blocks)
        policy = mixed_precision_policy(self.config.precision, self.config.ddp.compression.name)
        options = {"mesh": mesh, "mp_policy": policy, "reshard_after_forward": parallel.reshard_after_forward}
        for _, block in blocks:
            fully_shard(block, **options)
        fully_shard(model, **options)
        self.units = [name for name, _ in blocks] + [""]
        self._root = model  # type: ignore[assignment]
        self._fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for module in self._fsdp_modules:
            module.set_custom_all_gather(_MeteredAllGather(self.meter))
            module.set_custom_reduce_scatter(_MeteredReduceScatter(self.meter))
            if self.name == "hsdp":
                module.set_all_reduce_hook(self.meter.all_reduced)
        if self.dist.is_main:
            self._say_units(model, mesh, blocks)

    def _say_units(self, model: nn.Module, mesh: DeviceMesh, blocks: list[tuple[str, nn.Module]]) -> None:
        """Which units there are, and a warning when the root still holds most parameters: the
        root's are gathered through the whole forward and backward, so sharding saves little."""
        shown = ", ".join(self.units[:-1][:4]) + (f", ... ({len(self.units) - 1} units)" if len(self.units) > 5 else "")
        total = sum(p.numel() for p in model.parameters())
        in_units = sum(p.numel() for _, block in blocks for p in block.parameters())
        self.logger.info(
            f"{self.name}: sharded over mesh {tuple(mesh.shape)} {mesh.mesh_dim_names}; units: "
            + (shown + " and the root" if blocks else "the root only")
            + f"; the root holds {1 - in_units / total:.0%} of the parameters"
        )
        if total and in_units / total < 0.5:
            self.logger.warning(
                f"{self.name}: the root unit holds {1 - in_units / total:.0%} of the parameters, gathered whole from "
                "the first forward to the end of backward: sharding saves little memory. Name the model's blocks with "
                "parallel.blocks (class names of its layers)."
            )

    def micro_step(self, synced: bool) -> ContextManager[None]:
        assert self._root is not None
        # Set before the forward: FSDP reads it in backward, and a micro-step may skip its backward.
        self._root.set_requires_gradient_sync(synced)
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def backward(self, record: StepRecord, synced: bool) -> Iterator[None]:
        before = self.meter.kinds["reduce_scatter"].calls
        yield
        if self.meter.kinds["reduce_scatter"].calls > before:
            self._reductions += 1

    @property
    def reductions(self) -> int:
        return self._reductions

    def reduce_unsynced(self) -> bool:
        """Reduce-scatter the gradients FSDP accumulated unreduced, as the window's last backward
        would have: each unit's post-backward, run with gradient sync on (FSDP keeps it a no-op
        for a unit with nothing to reduce), then the end-of-backward FSDP's own callback runs."""
        assert self._root is not None
        before = self.meter.kinds["reduce_scatter"].calls
        self._root.set_requires_gradient_sync(True)
        problem = compat.missing_fsdp_flush()
        if problem:
            raise GradsyncError(
                f"the window's last batch was skipped, and {problem}, so the gradients FSDP accumulated cannot be "
                "reduced without it. Skip batches before the window's last one's forward (e.g. decide with "
                "trainer.agree_any before `with trainer.step()`), or use torch " + compat.TESTED_TORCH + "."
            )
        TrainingState = compat.FSDP_FLUSH[-1].get()
        states = [module._get_fsdp_state() for module in self._fsdp_modules]
        groups = [group for state in states for group in state._fsdp_param_groups]
        for group in reversed(groups):  # backward order, as autograd runs them
            group.post_backward()
        for group in groups:
            group.finalize_backward()
            group._training_state = TrainingState.IDLE
        for state in states:
            state._training_state = TrainingState.IDLE
        if self.meter.kinds["reduce_scatter"].calls > before:
            self._reductions += 1
            return True
        return False

    def comm_counters(self) -> dict[str, float]:
        return tally_counters(self.meter.kinds)

    def take_exposed(self) -> list[tuple[Any, Any]]:
        return self.meter.take_spans()

    def clip_grad_norm(self, parameters: list[nn.Parameter], max_norm: float) -> float:
        return clip_dtensor_aware(parameters, max_norm)

    def describe(self) -> dict[str, Any]:
        assert self.mesh is not None
        return {"strategy": self.name, "mesh": dict(zip(self.mesh.mesh_dim_names or (), self.mesh.shape)), "units": len(self.units)}


class HSDPStrategy(FSDPStrategy):
    name = "hsdp"


def _local_world_size() -> str | None:
    return os.environ.get("LOCAL_WORLD_SIZE")  # set by torchrun and gradsync run
