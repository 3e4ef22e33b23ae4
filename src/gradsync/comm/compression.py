"""Gradient compression as DDP communication hooks, chosen by name, on Gloo and NCCL alike.

Every hook receives one DDP bucket (the flat gradients of several parameters), reduces it
across ranks and returns the averaged bucket. They share three rules:

- **Small tensors travel uncompressed.** Biases and norm weights are a sliver of the bytes but
  the most sensitive to quantisation, so parameters with at most one dimension or fewer than
  `min_numel` elements are all-reduced in fp32 beside the compressed part.
- **Every rank applies the identical update.** Each hook ends with data that is the same on all
  ranks (an all-reduced sum, or every rank's message decoded in rank order), so replicas never
  drift apart: a compressor that let them drift would silently train N different models.
- **Biased compressors carry their error forward** (`int8`, `topk`, `powersgd`): what was not
  sent this step is added to the next step's gradient, so the sum of applied updates tracks the
  sum of true gradients. The residuals live in the hook and are saved with checkpoints through
  `state_dict`.

`fp16` and `bf16` only round, so they keep no residual (as PyTorch's own hooks). PyTorch's
`bf16_compress_hook` refuses Gloo; casting and summing bf16 works on Gloo, so ours does that.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from gradsync.errors import ConfigError

COMPRESSIONS = ("none", "fp16", "bf16", "int8", "topk", "powersgd", "auto")


@dataclass(frozen=True)
class CompressionConfig:
    """Which compressor DDP's gradient buckets go through, and its knobs.

    name: one of COMPRESSIONS; "none" leaves DDP's own all-reduce in place; "auto" tries the
        candidates during the first steps and keeps the fastest (gradsync.comm.auto).
    min_numel: parameters smaller than this (and every 1-D parameter) are sent uncompressed.
    powersgd_rank: rank of PowerSGD's low-rank approximation (higher: closer to exact, more bytes).
    powersgd_start_step: optimizer steps of plain all-reduce before PowerSGD starts; PowerSGD
        from step 0 hurts accuracy. None lets the trainer pick ~10% of the planned steps.
    topk_ratio: fraction of each bucket's compressible elements that `topk` sends.
    max_accumulation_steps: "auto" only. Above 1, auto may also raise the micro-batches per
        optimizer step (a multiple of the trainer's `accumulation_steps`, up to this) when
        communication is still exposed after compression. That grows the global batch, which
        changes the optimisation (learning rate, steps per epoch), so it happens only when the
        user allows it. 1 (the default): auto never touches accumulation.
    """

    name: str = "none"
    min_numel: int = 1024
    powersgd_rank: int = 4
    powersgd_start_step: int | None = None
    topk_ratio: float = 0.05
    max_accumulation_steps: int = 1

    def __post_init__(self) -> None:
        if self.name not in COMPRESSIONS:
            raise ConfigError(
                f"compression {self.name!r} is unknown; use one of {', '.join(COMPRESSIONS)}."
            )
        if not isinstance(self.min_numel, int) or self.min_numel < 0:
            raise ConfigError(f"compression.min_numel={self.min_numel!r}: use an integer >= 0.")
        if not isinstance(self.powersgd_rank, int) or self.powersgd_rank < 1:
            raise ConfigError(f"compression.powersgd_rank={self.powersgd_rank!r}: use an integer >= 1 (4 is a good start).")
        if self.powersgd_start_step is not None and (
            not isinstance(self.powersgd_start_step, int) or self.powersgd_start_step < 2
        ):
            raise ConfigError(
                f"compression.powersgd_start_step={self.powersgd_start_step!r}: PowerSGD needs at least "
                "2 plain steps before it starts (its error feedback and warm start are built on them); "
                "use an integer >= 2, or None for ~10% of the planned steps."
            )
        if not 0 < self.topk_ratio <= 1:
            raise ConfigError(f"compression.topk_ratio={self.topk_ratio!r}: use a fraction in (0, 1], e.g. 0.05.")
        if isinstance(self.max_accumulation_steps, bool) or not isinstance(self.max_accumulation_steps, int) or self.max_accumulation_steps < 1:
            raise ConfigError(
                f"compression.max_accumulation_steps={self.max_accumulation_steps!r}: use an integer >= 1 "
                "(the most micro-batches per optimizer step auto may choose; 1 keeps accumulation as set)."
            )
        if self.max_accumulation_steps > 1 and self.name != "auto":
            raise ConfigError(
                f"compression.max_accumulation_steps={self.max_accumulation_steps} only lets name='auto' "
                f"raise accumulation; with {self.name!r} set the trainer's accumulation_steps yourself."
            )


class CompressionStats:
    """Running totals a metrics reader turns into compression ratio and encode/decode time.

    Times are wall time of the hook's own work; on CUDA that is the time to queue the kernels,
    not to run them.
    """

    __slots__ = ("raw_bytes", "sent_bytes", "encode_s", "decode_s")

    def __init__(self) -> None:
        self.raw_bytes = 0
        self.sent_bytes = 0
        self.encode_s = 0.0
        self.decode_s = 0.0

    def as_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in self.__slots__}


class _Layout:
    """Which slices of a bucket are compressed and which are sent as they are."""

    def __init__(self, bucket: dist.GradBucket, min_numel: int):
        compressed, plain = [], []
        offset = 0
        for gradient in bucket.gradients():
            numel = gradient.numel()
            target = compressed if gradient.dim() > 1 and numel >= min_numel else plain
            target.append((offset, offset + numel))
            offset += numel
        self.compressed = _merge(compressed)
        self.plain = _merge(plain)
        self.numel = offset
        self._packed: dict[str, torch.Tensor] = {}

    def gather(self, buffer: torch.Tensor, part: str, dtype: torch.dtype, multiple: int = 1) -> torch.Tensor:
        """The `part` ("plain" or "compressed") ranges of `buffer`, packed into a tensor of `dtype`.

        The tensor is this layout's own, reused every step: allocating bucket-sized tensors
        afresh costs page faults (CPU) each time, more than the copy itself. It is free again by
        the next step, because DDP waits for every bucket's future before backward returns.
        Its length is rounded up to `multiple` with zeros (int8's chunks), which no copy touches.
        """
        ranges = self.plain if part == "plain" else self.compressed
        numel = sum(end - start for start, end in ranges)
        out = self._packed.get(part)
        if out is None or out.dtype != dtype or out.device != buffer.device:
            padded = -(-numel // multiple) * multiple
            out = self._packed[part] = torch.zeros(padded, dtype=dtype, device=buffer.device)
        offset = 0
        for start, end in ranges:
            out[offset : offset + end - start].copy_(buffer[start:end])
            offset += end - start
        return out

    @staticmethod
    def scatter(buffer: torch.Tensor, ranges: list[tuple[int, int]], flat: torch.Tensor) -> None:
        """Copy `flat` back into the ranges, casting to the bucket's dtype on the way."""
        offset = 0
        for start, end in ranges:
            buffer[start:end].copy_(flat[offset : offset + end - start])
            offset += end - start


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in ranges:
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


class CompressionHook:
    """Base of the hooks: layout per bucket, the uncompressed part, stats, residual state.

    Subclasses implement `_reduce_compressed(flat, bucket_index) -> Future[Tensor]`, returning
    the averaged `flat`. Call the instance as a DDP hook: `ddp.register_comm_hook(group, hook)`.
    """

    error_feedback = False
    pack_multiple = 1  # the packed compressed part's length is rounded up to this, with zeros
    wire_dtype: torch.dtype | None = None  # the compressed part's dtype handed to the encoder, if not the bucket's

    def __init__(self, config: CompressionConfig, process_group: Any = None) -> None:
        self.config = config
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.stats = CompressionStats()
        self.residuals: dict[int, torch.Tensor] = {}
        self._layouts: dict[tuple[Any, ...], _Layout] = {}
        self.__name__ = self.__qualname__ = f"gradsync_{config.name}_hook"  # DDP logs hooks by name

    # Unannotated on purpose: DDP checks a hook's annotations by identity, and this module's
    # postponed (string) annotations would fail that check.
    def __call__(self, state, bucket):  # type: ignore[no-untyped-def]
        buffer = bucket.buffer()
        layout = self._layout(bucket)
        started = time.perf_counter()
        buffer.div_(self.world_size)
        futures = []
        if layout.plain:
            plain = layout.gather(buffer, "plain", buffer.dtype)
            self.stats.sent_bytes += plain.numel() * plain.element_size()
            futures.append(self._all_reduce(plain))
        if layout.compressed:
            # Error feedback accumulates in fp32 whatever the gradients' dtype.
            wire_dtype = self.wire_dtype or (torch.float32 if self.error_feedback else buffer.dtype)
            flat = layout.gather(buffer, "compressed", wire_dtype, self.pack_multiple)
            if self.error_feedback:
                flat = self._with_residual(bucket.index(), flat)
            futures.append(self._reduce_compressed(flat, bucket.index()))
        self.stats.raw_bytes += buffer.numel() * buffer.element_size()
        self.stats.encode_s += time.perf_counter() - started

        def unpack(done: torch.futures.Future) -> torch.Tensor:
            started = time.perf_counter()
            results = [future.value() for future in done.value()]
            if layout.plain:
                _Layout.scatter(buffer, layout.plain, _first(results.pop(0)))
            if layout.compressed:
                _Layout.scatter(buffer, layout.compressed, _first(results.pop(0)))
            self.stats.decode_s += time.perf_counter() - started
            return buffer

        return torch.futures.collect_all(futures).then(unpack)

    def _layout(self, bucket: dist.GradBucket) -> _Layout:
        # DDP rebuilds its buckets after the first backward, in the order gradients became ready:
        # same index and size, different order. The shapes in order identify a layout.
        key = (bucket.index(), tuple(gradient.shape for gradient in bucket.gradients()))
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = _Layout(bucket, self.config.min_numel)
        return layout

    def _with_residual(self, index: int, flat: torch.Tensor) -> torch.Tensor:
        """`flat` (the layout's packed fp32 copy) plus the error carried from the last step, in place."""
        residual = self.residuals.get(index)
        if residual is not None and residual.shape == flat.shape and residual.device == flat.device:
            flat.add_(residual)  # a new or rebuilt bucket starts without carried error
        return flat

    def _all_reduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        return dist.all_reduce(tensor, group=self.process_group, async_op=True).get_future()

    def _reduce_compressed(self, flat: torch.Tensor, index: int) -> torch.futures.Future:
        raise NotImplementedError

    def start(self, planned_steps: int | None) -> None:
        """Told the planned number of optimizer steps when training starts (PowerSGD's warm-up)."""

    def state_dict(self) -> dict[str, Any]:
        """Tensors and numbers only, so a checkpoint of it loads with `weights_only=True`."""
        # Copied: the hooks overwrite their residual tensors in place on the next step.
        return {"residuals": {index: r.detach().to("cpu", copy=True) for index, r in self.residuals.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.residuals = {int(index): r.clone() for index, r in state.get("residuals", {}).items()}


def _first(value: Any) -> torch.Tensor:
    return value[0] if isinstance(value, (list, tuple)) else value


class CastHook(CompressionHook):
    """fp16 or bf16: halve the bytes by rounding; the sum itself runs in the low precision.

    The bucket is divided by the world size before the cast (fp16 would overflow summing raw
    gradients of many ranks), and the result is cast back while it is copied into the bucket.
    """

    def __init__(self, config: CompressionConfig, process_group: Any = None) -> None:
        super().__init__(config, process_group)
        self.wire_dtype = torch.float16 if config.name == "fp16" else torch.bfloat16

    def _reduce_compressed(self, flat: torch.Tensor, index: int) -> torch.futures.Future:
        self.stats.sent_bytes += flat.numel() * flat.element_size()
        return self._all_reduce(flat)


class Int8Hook(CompressionHook):
    """Per-chunk scaled int8, summed in int8 without overflow, with error feedback.

    Ranks must quantise with the same scale per chunk for the integer sum to mean anything, and
    each rank gets at most 127 // world_size levels each way, so the sum cannot overflow. With
    more than 8 ranks that leaves too few levels, so the integers travel as int16 (half of fp32
    instead of a quarter).

    The scales are agreed one step ahead: with each bucket, every rank also sends its chunk
    maxima (1/256 of the bytes), and the next step quantises against those, with headroom.
    Agreeing first and quantising after would put a network round trip on the backward's
    critical path for every bucket. Values beyond the stale range are clipped and the clipped
    part goes into the residual, so error feedback sends it later. All collectives are issued
    from the backward thread, so every rank issues them in the same order.
    """

    error_feedback = True
    CHUNK = 256
    pack_multiple = CHUNK
    HEADROOM = 1.5  # the agreed range is last step's maximum times this

    def __init__(self, config: CompressionConfig, process_group: Any = None) -> None:
        super().__init__(config, process_group)
        self.carrier = torch.int8 if self.world_size <= 8 else torch.int16
        self.levels = (127 if self.carrier == torch.int8 else 32767) // self.world_size
        self._next_scales: dict[int, tuple[Any, torch.Tensor]] = {}  # (pending work or None, maxima)
        self._quantised: dict[int, torch.Tensor] = {}

    def _reduce_compressed(self, flat: torch.Tensor, index: int) -> torch.futures.Future:
        # The packed part comes padded to whole chunks (zeros), and the work tensors are this
        # bucket's own, reused: fresh bucket-sized tensors cost more than the arithmetic.
        chunks = flat.view(-1, self.CHUNK)
        chunk_max = chunks.abs().amax(dim=1)
        agreed = self._next_scales.pop(index, None)
        if agreed is not None and agreed[1].shape == chunk_max.shape:
            if agreed[0] is not None:
                agreed[0].wait()  # sent with last step's bucket: long done
            limit = agreed[1] * self.HEADROOM
        else:  # the first step (or a rebuilt bucket): agree now, once
            limit = chunk_max.clone()
            dist.all_reduce(limit, op=dist.ReduceOp.MAX, group=self.process_group)
        scale = (limit / self.levels).clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(1)
        quantised = self._work_tensor(self._quantised, index, chunks)
        torch.div(chunks, scale, out=quantised).round_().clamp_(-self.levels, self.levels)
        residual = self._work_tensor(self.residuals, index, chunks)  # last step's, already added in
        torch.sub(chunks, torch.mul(quantised, scale, out=residual), out=residual)
        self.residuals[index] = residual.view(-1)
        integers = quantised.to(self.carrier)
        self.stats.sent_bytes += integers.numel() * integers.element_size() + chunk_max.numel() * chunk_max.element_size()
        reduced = self._all_reduce(integers).then(lambda f: (_first(f.value()).float() * scale).view(-1))
        work = dist.all_reduce(chunk_max, op=dist.ReduceOp.MAX, group=self.process_group, async_op=True)
        self._next_scales[index] = (work, chunk_max)
        return reduced

    @staticmethod
    def _work_tensor(store: dict[int, torch.Tensor], index: int, like: torch.Tensor) -> torch.Tensor:
        tensor = store.get(index)
        if tensor is None or tensor.numel() != like.numel() or tensor.device != like.device:
            tensor = store[index] = torch.empty_like(like)
        return tensor.view_as(like)

    def state_dict(self) -> dict[str, Any]:
        """Residuals and the scales agreed for the next step (a resumed run quantises the same)."""
        scales = {}
        for index, (work, chunk_max) in self._next_scales.items():
            work.wait()
            scales[index] = chunk_max.detach().cpu()
        return {**super().state_dict(), "next_scales": scales}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._next_scales = {int(index): (None, limit.clone()) for index, limit in state.get("next_scales", {}).items()}


class TopKHook(CompressionHook):
    """Send the largest `topk_ratio` of each bucket by magnitude (values and indices), with error feedback.

    Every rank gathers every rank's selection and adds them up in rank order, so the result is
    identical everywhere without relying on the order of atomic adds.
    """

    error_feedback = True

    def _reduce_compressed(self, flat: torch.Tensor, index: int) -> torch.futures.Future:
        numel = flat.numel()
        k = max(1, int(numel * self.config.topk_ratio))
        _, chosen = flat.abs().topk(k, sorted=False)
        values = flat[chosen]
        residual = flat.clone()
        residual[chosen] = 0
        self.residuals[index] = residual
        message = torch.cat([values, chosen.to(torch.int32).view(torch.float32)])
        self.stats.sent_bytes += message.numel() * message.element_size() * (self.world_size - 1)
        gathered = torch.empty(self.world_size * message.numel(), dtype=message.dtype, device=message.device)
        # torch 2.13 renamed all_gather_into_tensor (deprecated, warning on use) to all_gather_single.
        gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        work = gather_tensor(gathered, message, group=self.process_group, async_op=True)

        def add_up(_: Any) -> torch.Tensor:
            total = torch.zeros_like(flat)
            for part in gathered.view(self.world_size, 2 * k):
                total.index_add_(0, part[k:].view(torch.int32).long(), part[:k])
            return total

        return work.get_future().then(add_up)


class PowerSGDHook(CompressionHook):
    """PyTorch's PowerSGD with error feedback and warm start; plain all-reduce during its warm-up.

    PyTorch's hook already sends 1-D tensors uncompressed and skips matrices it would not shrink
    (`min_compression_rate`), so this only adds the start step and checkpointable state.
    """

    def __init__(self, config: CompressionConfig, process_group: Any = None) -> None:
        super().__init__(config, process_group)
        self.power_state = powerSGD_hook.PowerSGDState(
            process_group=process_group,
            matrix_approximation_rank=config.powersgd_rank,
            start_powerSGD_iter=config.powersgd_start_step or 1_000_000_000,
            min_compression_rate=2,
            use_error_feedback=True,
            warm_start=True,
            compression_stats_logging_frequency=1 << 62,  # gradsync reports its own metrics
        )
        self._serialize = dist.get_backend(process_group) == "gloo"
        self._previous: torch.futures.Future | None = None

    def __call__(self, state, bucket):  # type: ignore[no-untyped-def]
        if self._previous is not None:
            # PyTorch's hook waits for its second and third all-reduce inside future callbacks,
            # which on Gloo run on the group's two worker threads: two buckets in flight block
            # both threads and deadlock. One bucket at a time keeps a thread free.
            self._previous.wait()
        started = time.perf_counter()
        raw = bucket.buffer().numel() * bucket.buffer().element_size()
        before = self.power_state.total_numel_after_compression
        future = powerSGD_hook.powerSGD_hook(self.power_state, bucket)
        self.stats.raw_bytes += raw
        after = self.power_state.total_numel_after_compression
        # PowerSGD counts elements only once it compresses; before that it sends the bucket whole.
        self.stats.sent_bytes += (after - before) * bucket.buffer().element_size() if after != before else raw
        self.stats.encode_s += time.perf_counter() - started
        if self._serialize:
            self._previous = None if bucket.is_last() else future
        return future

    def start(self, planned_steps: int | None) -> None:
        if self.config.powersgd_start_step is None:
            self.power_state.start_powerSGD_iter = max(2, (planned_steps or 0) // 10)

    def state_dict(self) -> dict[str, Any]:
        state = self.power_state
        kind, keys, position, has_gauss, gauss = state.rng.get_state()
        return {
            "iter": state.iter,
            "start_step": state.start_powerSGD_iter,
            "error_dict": {k: v.detach().cpu() for k, v in state.error_dict.items()},
            "p_memory_dict": {k: v.detach().cpu() for k, v in state.p_memory_dict.items()},
            "q_memory_dict": {k: v.detach().cpu() for k, v in state.q_memory_dict.items()},
            "rng": {"keys": torch.from_numpy(keys.astype("int64")), "position": position, "has_gauss": has_gauss, "gauss": gauss},
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        import numpy

        state = self.power_state
        state.iter = int(saved["iter"])
        state.start_powerSGD_iter = int(saved["start_step"])
        state.error_dict = {int(k): v.clone() for k, v in saved["error_dict"].items()}
        state.p_memory_dict = {int(k): v.clone() for k, v in saved["p_memory_dict"].items()}
        state.q_memory_dict = {int(k): v.clone() for k, v in saved["q_memory_dict"].items()}
        rng = saved["rng"]
        state.rng.set_state(("MT19937", rng["keys"].numpy().astype(numpy.uint32), rng["position"], rng["has_gauss"], rng["gauss"]))


_HOOKS = {"fp16": CastHook, "bf16": CastHook, "int8": Int8Hook, "topk": TopKHook, "powersgd": PowerSGDHook}


def make_hook(config: CompressionConfig, process_group: Any = None) -> CompressionHook | None:
    """The hook for `config`, or None for "none" (DDP's own all-reduce). "auto" is built by
    gradsync.comm.auto.AutoTuner, which needs the trainer's step boundaries."""
    if config.name == "none":
        return None
    if config.name == "auto":
        raise ValueError("compression 'auto' is an AutoTuner (gradsync.comm.auto), not a single hook")
    return _HOOKS[config.name](config, process_group)
