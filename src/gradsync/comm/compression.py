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
import zlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from gradsync.errors import ConfigError

COMPRESSIONS = ("none", "fp16", "bf16", "int8", "topk", "powersgd", "auto")


@dataclass(frozen=True)
class CompressionConfig:
    """Which compressor DDP's gradient buckets go through, and its knobs.

    name: one of COMPRESSIONS; "none" leaves DDP's own all-reduce in place; "auto" tries the
        candidates during the first steps and keeps the fastest (gradsync.comm.auto).
    min_numel: parameters smaller than this (and every 1-D parameter) are sent uncompressed.
    powersgd_rank: rank of PowerSGD's low-rank approximation (higher: closer to exact, more bytes).
    powersgd_start_step: optimizer steps of plain all-reduce before PowerSGD starts. PowerSGD
        from the first step hurts accuracy (early gradients are large and change fast), as
        PowerSGD's authors found. None lets the trainer pick ~10% of the planned steps.
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
            isinstance(self.powersgd_start_step, bool) or not isinstance(self.powersgd_start_step, int)
            or self.powersgd_start_step < 0
        ):
            raise ConfigError(
                f"compression.powersgd_start_step={self.powersgd_start_step!r}: use the number of plain steps "
                "before PowerSGD starts (an integer >= 0), or None for ~10% of the planned steps."
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
    """Which parameters of a bucket are compressed and which are sent as they are, and where.

    The compressed parameters are packed one after another, each padded to a multiple of
    `multiple` (int8's chunks): a chunk never spans two parameters, so what a hook computes per
    chunk does not depend on which parameters share a bucket, nor on their order.
    """

    def __init__(self, bucket: dist.GradBucket, min_numel: int, keys: tuple[str, ...], multiple: int = 1):
        self.params: list[tuple[str, int, int, tuple[int, ...]]] = []  # (key, start, end, shape) in bucket order
        self.compressed_params: list[tuple[str, int, int]] = []  # (key, packed offset, padded length)
        plain: list[tuple[int, int]] = []
        copies: list[tuple[int, int, int]] = []  # (bucket start, bucket end, packed offset), merged
        offset = packed = 0
        for key, gradient in zip(keys, bucket.gradients()):
            numel = gradient.numel()
            self.params.append((key, offset, offset + numel, tuple(gradient.shape)))
            if gradient.dim() > 1 and numel >= min_numel:
                padded = -(-numel // multiple) * multiple
                self.compressed_params.append((key, packed, padded))
                if copies and copies[-1][1] == offset and copies[-1][2] + copies[-1][1] - copies[-1][0] == packed:
                    copies[-1] = (copies[-1][0], offset + numel, copies[-1][2])
                else:
                    copies.append((offset, offset + numel, packed))
                packed += padded
            else:
                plain.append((offset, offset + numel))
            offset += numel
        self.plain = _merge(plain)
        self.compressed = copies
        self.packed_numel = packed
        self.numel = offset
        self._packed: dict[str, torch.Tensor] = {}

    def gather(self, buffer: torch.Tensor, part: str, dtype: torch.dtype, divisor: int) -> torch.Tensor:
        """The `part` ("plain" or "compressed") of `buffer` divided by `divisor`, packed into a
        tensor of `dtype`. Dividing while copying saves a whole pass over the bucket.

        The tensor is this layout's own, reused every step: allocating bucket-sized tensors
        afresh costs page faults (CPU) each time, more than the copy itself. It is free again by
        the next step, because DDP waits for every bucket's future before backward returns.
        The compressed part's padding is zeros, which no copy touches.
        """
        copies = [(start, end, None) for start, end in self.plain] if part == "plain" else self.compressed
        numel = sum(end - start for start, end in self.plain) if part == "plain" else self.packed_numel
        out = self._packed.get(part)
        if out is None or out.dtype != dtype or out.device != buffer.device:
            out = self._packed[part] = torch.zeros(numel, dtype=dtype, device=buffer.device)
        position = 0
        for start, end, packed in copies:
            position = position if packed is None else packed
            torch.div(buffer[start:end], divisor, out=out[position : position + end - start])
            position += end - start
        return out

    def scatter(self, buffer: torch.Tensor, part: str, flat: torch.Tensor) -> None:
        """Copy `flat` back into the part's place in `buffer`, casting to the bucket's dtype."""
        copies = [(start, end, None) for start, end in self.plain] if part == "plain" else self.compressed
        position = 0
        for start, end, packed in copies:
            position = position if packed is None else packed
            buffer[start:end].copy_(flat[position : position + end - start])
            position += end - start


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in ranges:
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


class CompressionHook:
    """Base of the hooks: layout per bucket, the uncompressed part, stats, per-parameter state.

    Subclasses implement `_reduce_compressed(flat, bucket_index, layout) -> Future[Tensor]`, returning
    the averaged `flat`. Call the instance as a DDP hook: `ddp.register_comm_hook(group, hook)`.

    State carried between steps (residuals, int8's scales, PowerSGD's) is kept per bucket, but
    belongs to parameters: DDP rebuilds its buckets after the first backward (other order, other
    sizes), and a resumed run starts again from the first layout. When a bucket's parameters
    change, the state is moved through a per-parameter form into the new layout, and checkpoints
    hold that per-parameter form. `bind(module)` names the parameters (the trainer does it), so
    a checkpoint's state finds its parameters in another process.
    """

    error_feedback = False
    pack_multiple = 1  # each compressed parameter's packed length is rounded up to this, with zeros
    wire_dtype: torch.dtype | None = None  # the compressed part's dtype handed to the encoder, if not the bucket's

    def __init__(self, config: CompressionConfig, process_group: Any = None) -> None:
        self.config = config
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.stats = CompressionStats()
        self.residuals: dict[int, torch.Tensor] = {}
        self._layouts: dict[tuple[Any, ...], _Layout] = {}
        self._names: dict[int, str] = {}  # parameter data pointer -> name, from bind()
        self._state_layouts: dict[int, _Layout] = {}  # the layout each bucket's state is laid out in
        self._unplaced: dict[str, dict[str, torch.Tensor]] = {}  # per-parameter state awaiting its bucket
        self.__name__ = self.__qualname__ = f"gradsync_{config.name}_hook"  # DDP logs hooks by name

    def bind(self, module: torch.nn.Module) -> None:
        """Name the parameters of the module DDP wraps, so saved state finds them after a restart."""
        self._names = {p.data_ptr(): name for name, p in module.named_parameters()}

    # Unannotated on purpose: DDP checks a hook's annotations by identity, and this module's
    # postponed (string) annotations would fail that check.
    def __call__(self, state, bucket):  # type: ignore[no-untyped-def]
        buffer = bucket.buffer()
        layout = self._follow_layout(bucket)
        started = time.perf_counter()
        futures = []
        if layout.plain:
            plain = layout.gather(buffer, "plain", buffer.dtype, self.world_size)
            self.stats.sent_bytes += plain.numel() * plain.element_size()
            futures.append(self._all_reduce(plain))
        if layout.compressed:
            # Error feedback accumulates in fp32 whatever the gradients' dtype.
            wire_dtype = self.wire_dtype or (torch.float32 if self.error_feedback else buffer.dtype)
            flat = layout.gather(buffer, "compressed", wire_dtype, self.world_size)
            if self.error_feedback:
                flat = self._with_residual(bucket.index(), flat)
            futures.append(self._reduce_compressed(flat, bucket.index(), layout))
        self.stats.raw_bytes += buffer.numel() * buffer.element_size()
        self.stats.encode_s += time.perf_counter() - started

        # On CUDA the hook's future must carry the device: collect_all's own future does not, so
        # DDP would read the bucket without waiting for the copies below (seen on Gloo with CUDA
        # tensors: replicas drifted apart from the first step). A device-aware future records
        # an event on the stream the copies ran on, and DDP's wait() orders its stream after it.
        reduced = torch.futures.Future(devices=[buffer.device]) if buffer.is_cuda else torch.futures.Future()

        def unpack(done: torch.futures.Future) -> None:
            try:
                started = time.perf_counter()
                # wait(), not value(): on CUDA it makes this stream wait for each reduction's copy
                # back to the GPU, which the backend may still be running on a stream of its own.
                results = [future.wait() for future in done.value()]
                if layout.plain:
                    layout.scatter(buffer, "plain", _first(results.pop(0)))
                if layout.compressed:
                    layout.scatter(buffer, "compressed", _first(results.pop(0)))
                self.stats.decode_s += time.perf_counter() - started
                reduced.set_result(buffer)
            except BaseException as error:  # a failed reduction fails the hook's future, as DDP expects
                reduced.set_exception(error)

        torch.futures.collect_all(futures).add_done_callback(unpack)
        return reduced

    def _follow_layout(self, bucket: dist.GradBucket) -> _Layout:
        """This bucket's layout; state laid out for another layout is moved to this one first."""
        parameters = bucket.parameters()
        key = (bucket.index(), *(p.data_ptr() for p in parameters))
        layout = self._layouts.get(key)
        if layout is None:
            names = tuple(self._names.get(p.data_ptr()) or f"@{p.data_ptr()}" for p in parameters)
            layout = self._layouts[key] = _Layout(bucket, self.config.min_numel, names, self.pack_multiple)
        index = bucket.index()
        previous = self._state_layouts.get(index)
        if previous is not layout:
            if previous is not None:
                # DDP rebuilt its buckets: every bucket's state goes back to its parameters.
                self._settle()
                for old_index, old_layout in self._state_layouts.items():
                    _add_pieces(self._unplaced, self._state_pieces(old_index, old_layout))
                self._drop_bucket_state()
                self._state_layouts.clear()
            if self._unplaced:
                self._place_state(index, layout, self._unplaced)
            self._state_layouts[index] = layout
        return layout

    def _state_pieces(self, index: int, layout: _Layout) -> dict[str, dict[str, torch.Tensor]]:
        """Bucket `index`'s state, cut into its parameters' pieces (copies)."""
        residual = self.residuals.get(index)
        if residual is None or residual.numel() != layout.packed_numel:
            return {}
        return {key: {"residual": residual[at : at + length].detach().clone()} for key, at, length in layout.compressed_params}

    def _place_state(self, index: int, layout: _Layout, pieces: dict[str, dict[str, torch.Tensor]]) -> None:
        """Assemble bucket `index`'s state from its parameters' pieces (taken out of `pieces`)."""
        residual = _join([key for key, _, _ in layout.compressed_params], pieces, "residual")
        if residual is not None:
            self.residuals[index] = residual

    def _drop_bucket_state(self) -> None:
        self.residuals.clear()

    def _settle(self) -> None:
        """Finish work still updating bucket state (before the state is moved)."""

    def _with_residual(self, index: int, flat: torch.Tensor) -> torch.Tensor:
        """`flat` (the layout's packed fp32 copy) plus the error carried from the last step, in place."""
        residual = self.residuals.get(index)
        if residual is not None and residual.shape == flat.shape and residual.device == flat.device:
            flat.add_(residual)
        return flat

    def _all_reduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        return dist.all_reduce(tensor, group=self.process_group, async_op=True).get_future()

    def _reduce_compressed(self, flat: torch.Tensor, index: int, layout: _Layout) -> torch.futures.Future:
        raise NotImplementedError

    def start(self, planned_steps: int | None) -> None:
        """Told the planned number of optimizer steps when training starts (PowerSGD's warm-up)."""

    def state_dict(self) -> dict[str, Any]:
        """Tensors and numbers only, so a checkpoint of it loads with `weights_only=True`.

        Per parameter (by name once bound), not per bucket: the run that loads it starts with
        DDP's first bucket layout, not the rebuilt one this run has now.
        """
        self._settle()
        pieces = {key: dict(state) for key, state in self._unplaced.items()}
        for index, layout in self._state_layouts.items():
            _add_pieces(pieces, self._state_pieces(index, layout))
        return {"parameters": {key: {name: t.to("cpu", copy=True) for name, t in state.items()} for key, state in pieces.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._drop_bucket_state()
        self._state_layouts.clear()
        self._unplaced = {key: {name: t.clone() for name, t in parts.items()} for key, parts in state.get("parameters", {}).items()}


def _add_pieces(into: dict[str, dict[str, torch.Tensor]], pieces: dict[str, dict[str, torch.Tensor]]) -> None:
    for key, parts in pieces.items():
        into.setdefault(key, {}).update(parts)


def _join(keys: list[str], pieces: dict[str, dict[str, torch.Tensor]], name: str) -> torch.Tensor | None:
    """The pieces `name` of parameters `keys`, concatenated in that order and taken out of
    `pieces`; None (and nothing taken) when a parameter has none: that bucket starts afresh."""
    if not keys or not all(name in pieces.get(key, {}) for key in keys):
        return None
    joined = torch.cat([pieces[key].pop(name) for key in keys])
    for key in keys:
        if not pieces[key]:
            del pieces[key]  # all its state is placed
    return joined


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

    def _reduce_compressed(self, flat: torch.Tensor, index: int, layout: _Layout) -> torch.futures.Future:
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
        self._carriers: dict[int, torch.Tensor] = {}  # the integers sent, per bucket
        self._decoded: dict[int, torch.Tensor] = {}  # the reduced integers times the scales, per bucket

    def _reduce_compressed(self, flat: torch.Tensor, index: int, layout: _Layout) -> torch.futures.Future:
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
        integers = self._work_tensor(self._carriers, index, quantised, self.carrier)
        integers.copy_(quantised)
        self.stats.sent_bytes += integers.numel() * integers.element_size() + chunk_max.numel() * chunk_max.element_size()
        # Sent from, and decoded into, tensors of this bucket's: the decode runs on one of Gloo's
        # threads, whose freed heap glibc gives back to the OS whatever host_memory says, so
        # fresh tensors there were paged in again and again (ResNet-18, 2 hosts: 730-4,400
        # faults a step before, 430-1,300 after, and 0.7% off the step).
        decoded = self._work_tensor(self._decoded, index, chunks)
        reduced = self._all_reduce(integers).then(lambda f: torch.mul(_first(f.value()), scale, out=decoded).view(-1))
        work = dist.all_reduce(chunk_max, op=dist.ReduceOp.MAX, group=self.process_group, async_op=True)
        self._next_scales[index] = (work, chunk_max)
        return reduced

    @staticmethod
    def _work_tensor(store: dict[int, torch.Tensor], index: int, like: torch.Tensor,
                     dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or like.dtype
        tensor = store.get(index)
        if tensor is None or tensor.numel() != like.numel() or tensor.device != like.device or tensor.dtype != dtype:
            tensor = store[index] = torch.empty_like(like, dtype=dtype)
        return tensor.view_as(like)

    # Residuals and the scales agreed for the next step are state (a resumed run quantises the same).
    def _settle(self) -> None:
        for index, (work, chunk_max) in self._next_scales.items():
            if work is not None:
                work.wait()
                self._next_scales[index] = (None, chunk_max)

    def _state_pieces(self, index: int, layout: _Layout) -> dict[str, dict[str, torch.Tensor]]:
        pieces = super()._state_pieces(index, layout)
        agreed = self._next_scales.get(index)
        if agreed is not None and agreed[1].numel() * self.CHUNK == layout.packed_numel:  # settled by the caller
            for key, at, length in layout.compressed_params:
                piece = agreed[1][at // self.CHUNK : (at + length) // self.CHUNK].detach().clone()
                pieces.setdefault(key, {})["next_scales"] = piece
        return pieces

    def _place_state(self, index: int, layout: _Layout, pieces: dict[str, dict[str, torch.Tensor]]) -> None:
        super()._place_state(index, layout, pieces)
        scales = _join([key for key, _, _ in layout.compressed_params], pieces, "next_scales")
        if scales is not None:
            self._next_scales[index] = (None, scales)

    def _drop_bucket_state(self) -> None:
        super()._drop_bucket_state()
        self._next_scales.clear()
        for work in (self._quantised, self._carriers, self._decoded):
            work.clear()


class TopKHook(CompressionHook):
    """Send the largest `topk_ratio` of each parameter by magnitude (values and indices), with error feedback.

    Chosen per parameter, not per bucket: what is sent then does not depend on which parameters
    DDP put together, so a run resumed in DDP's first bucket layout continues exactly. Every
    rank gathers every rank's selection and adds them up in rank order, so the result is
    identical everywhere without relying on the order of atomic adds.
    """

    error_feedback = True

    def _reduce_compressed(self, flat: torch.Tensor, index: int, layout: _Layout) -> torch.futures.Future:
        magnitudes = flat.abs()
        chosen = torch.cat([
            magnitudes[at : at + length].topk(max(1, int(length * self.config.topk_ratio)), sorted=False).indices + at
            for _, at, length in layout.compressed_params
        ])
        k = chosen.numel()
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


# A PowerSGD group whose collectives are under way: its buckets with the futures DDP waits on,
# and the stages left to run (PowerSGDHook._reduce_group).
_GroupInFlight = tuple[list[tuple[dist.GradBucket, torch.futures.Future]], Iterator[None]]


class PowerSGDHook(CompressionHook):
    """PowerSGD (Vogels et al., 2019): each gradient matrix M is sent as two thin factors, P = MQ
    and Q = M^T P (rank `powersgd_rank`), with error feedback and warm start; plain all-reduce
    before `powersgd_start_step`.

    Written here rather than wrapping PyTorch's `powerSGD_hook`, for reasons measured on Gloo.
    PyTorch's hook compresses one DDP bucket at a time and pays three collectives for each:
    with small buckets (which the casts and int8 want, to overlap with backward) their latency
    adds up, at 30 buckets to a slower step than bf16's. This one reduces DDP's buckets in
    groups of about an eighth of the model's gradients (1 to 25 MB; `group_bytes_for`),
    whatever the bucket size: few enough that latency stays small, small enough that little is
    left to reduce when backward ends. PyTorch's hook waits for its
    second and third all-reduce inside future callbacks, which on Gloo run on the group's two
    worker threads, so two buckets in flight deadlock; this one runs a group in stages on the
    thread running backward: each stage ends by issuing a collective, and the next stage
    (waiting for it, then going on) runs at the next bucket's hook, which every rank reaches in
    the same order. So backward computes the next buckets' gradients while P and Q travel, and
    the last bucket's hook finishes every group. (A thread of its own did the same and cost
    more than it hid on the CPU: the worker's heap was given back to the OS and faulted in
    again, ~55 MB a step, and the two threads shared one core; docs/performance.md has the
    measurements.) Its factors are kept transposed, so that the products with them stream the
    gradient row by row (2.5-3.3x faster on one CPU thread). And it makes eight passes over the
    gradients where PyTorch's makes eleven: the new error is computed in one fused `addmm`
    instead of from a full copy of the input.

    State is kept per parameter (by name once bound): the error of each matrix and its Q, so a
    checkpoint does not depend on DDP's bucket layout. The first Q of a matrix is drawn from a
    generator seeded by the parameter's name, the same on every rank.
    """

    error_feedback = True
    GROUP_BYTES = 25 * 2**20  # the most a group holds before it is cut (DDP's default bucket size)
    MIN_GROUP_BYTES = 2**20
    GROUPS_PER_BACKWARD = 8  # see group_bytes_for
    MIN_COMPRESSION_RATE = 2  # a matrix is compressed only if its factors are at most half its size

    def __init__(self, config: CompressionConfig, process_group: Any = None) -> None:
        super().__init__(config, process_group)
        # Until the trainer says how long the run is (start()), plain all-reduce.
        self.start_step = 1_000_000_000 if config.powersgd_start_step is None else config.powersgd_start_step
        self.steps = 0  # synchronised backward passes so far
        self.errors: dict[str, torch.Tensor] = {}
        self.factors_qt: dict[str, torch.Tensor] = {}  # each matrix's Q, transposed
        self._pending: list[tuple[dist.GradBucket, torch.futures.Future]] = []  # buckets of the group being filled
        self._pending_bytes = 0
        self._in_flight: list[_GroupInFlight] = []
        self._backward_bytes = 0  # gradient bytes of this backward's buckets so far
        self._group_bytes = self.GROUP_BYTES  # until a backward has shown the model's size
        self._packed: dict[str, torch.Tensor] = {}

    def __call__(self, state, bucket):  # type: ignore[no-untyped-def]
        buffer = bucket.buffer()
        size = buffer.numel() * buffer.element_size()
        self.stats.raw_bytes += size
        if bucket.index() == 0:
            # A new backward. One that failed midway left its buckets and groups behind.
            self._backward_bytes, self._pending, self._pending_bytes, self._in_flight = 0, [], 0, []
        self._backward_bytes += size
        if self.steps < self.start_step:
            if bucket.is_last():
                self._end_backward()
            self.stats.sent_bytes += size
            buffer.div_(self.world_size)
            return self._all_reduce(buffer).then(lambda done: buffer)
        # Set once its group is reduced; on CUDA the future must know the device its tensor lives on.
        future: torch.futures.Future = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)
        # Every group in flight takes its next stage first: each bucket's hook is a point that
        # every rank reaches in the same order (DDP runs them in bucket order), so the
        # collectives these stages issue are issued in the same order everywhere.
        self._advance(self._in_flight)
        self._pending.append((bucket, future))
        self._pending_bytes += size
        if self._pending_bytes >= self._group_bytes or bucket.is_last():
            group, self._pending, self._pending_bytes = self._pending, [], 0
            stages = self._reduce_group([b for b, _ in group])
            self._in_flight.append((group, stages))
            self._advance(self._in_flight[-1:])
            if bucket.is_last():
                while self._in_flight:
                    self._advance(self._in_flight)
                self._end_backward()
        return future

    def _end_backward(self) -> None:
        """Count the synchronised backward, and size the next backward's groups from this one's bytes."""
        self.steps += 1
        self._group_bytes = self.group_bytes_for(self._backward_bytes)

    @classmethod
    def group_bytes_for(cls, backward_bytes: int) -> int:
        """The bytes at which a group of buckets is cut, for a backward of `backward_bytes` of
        gradients: about GROUPS_PER_BACKWARD groups, within MIN_GROUP_BYTES and GROUP_BYTES.

        The last group's products and both its round trips come after backward has ended. On
        ResNet-18 (2 hosts at 300 Mbit/s, auto's 1.4 MB buckets) the last bucket's hook took a
        median 24-35 ms of a 1.3 s step with groups of 25 MB, 9 ms with groups of 6 MB. Below
        MIN_GROUP_BYTES, the collectives' fixed cost would add up. Every rank has the same
        buckets, hence the same groups. Groups are cut between buckets only: cutting inside
        DDP's 25 MB buckets gained nothing measurable (docs/performance.md).
        """
        return min(cls.GROUP_BYTES, max(cls.MIN_GROUP_BYTES, backward_bytes // cls.GROUPS_PER_BACKWARD))

    def _advance(self, groups: list[_GroupInFlight]) -> None:
        """Run each group's next stage (up to its next collective); a finished group sets its buckets' futures."""
        for entry in list(groups):
            group, stages = entry
            try:
                done = next(stages, True) is True
            except BaseException as error:  # DDP raises it from backward, on the user's thread
                # Collectives after a failed one cannot match across ranks: fail every group in flight.
                for failed, _ in self._in_flight:
                    for _, waiting in failed:
                        waiting.set_exception(error)
                self._in_flight = []
                return
            if done:
                self._in_flight.remove(entry)
                for bucket, waiting in group:
                    waiting.set_result(bucket.buffer())

    def _reduce_group(self, buckets: list[dist.GradBucket]) -> Iterator[None]:
        """PowerSGD on a group of buckets, in stages: it yields after issuing each collective it
        must wait for, and the hook resumes it at the next bucket. On Gloo a collective blocks
        the thread that waits for it, so waiting later lets backward compute the next buckets'
        gradients while P and Q travel; on NCCL the waits only order streams."""
        started = time.perf_counter()
        plain: list[torch.Tensor] = []
        matrices: list[tuple[str, torch.Tensor, torch.Tensor, int]] = []  # (key, gradient as a matrix, its fp32 work copy, rank)
        for bucket in buckets:
            for parameter, gradient in zip(bucket.parameters(), bucket.gradients()):
                rows = gradient.shape[0] if gradient.dim() else 1
                columns = gradient.numel() // rows if rows else 0
                rank = min(rows, columns, self.config.powersgd_rank)
                if (gradient.dim() <= 1 or gradient.numel() < self.config.min_numel
                        or (rows + columns) * rank * self.MIN_COMPRESSION_RATE > rows * columns):
                    plain.append(gradient)
                    continue
                matrix = gradient.view(rows, columns)
                work = matrix if matrix.dtype == torch.float32 else matrix.float()  # error feedback accumulates in fp32
                key = self._names.get(parameter.data_ptr()) or f"@{parameter.data_ptr()}"
                matrices.append((key, matrix, work, rank))
        # DDP's buckets hold one dtype each, a group may hold several: one exact all-reduce per dtype.
        # Work tensors are named by the group's first bucket: groups in flight at once need their own.
        first = buckets[0].index()
        plain_by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for gradient in plain:
            plain_by_dtype.setdefault(gradient.dtype, []).append(gradient)
        plain_work = []
        for dtype, tensors in plain_by_dtype.items():
            flat = self._pack(f"plain {dtype} {first}", tensors, dtype)
            flat.div_(self.world_size)
            self.stats.sent_bytes += flat.numel() * flat.element_size()
            plain_work.append((dist.all_reduce(flat, group=self.process_group, async_op=True), dtype, tensors))
        if matrices:
            # The factors are kept transposed (rank x rows, rank x columns): a product with rank
            # 4 rows streams the gradient once, row by row, where the tall-and-thin product
            # ran 2.5-3.3x slower on one CPU thread (ResNet-18: 5 ms each instead of 13-18).
            device = matrices[0][2].device
            p_all = self._work(f"p {first}", sum(work.shape[0] * r for _, _, work, r in matrices), torch.float32, device)
            pts, at = [], 0
            for key, _, work, rank in matrices:
                error = self.errors.get(key)
                if error is not None:
                    work.add_(error)
                pt = p_all[at : at + work.shape[0] * rank].view(rank, work.shape[0])
                torch.mm(self._qt(key, work.shape[1], rank, work.device), work.t(), out=pt)
                pts.append(pt)
                at += pt.numel()
            self.stats.sent_bytes += p_all.numel() * p_all.element_size()
            reducing = dist.all_reduce(p_all, group=self.process_group, async_op=True)
            self.stats.encode_s += time.perf_counter() - started
            yield
            reducing.wait()
            started = time.perf_counter()
            q_all = self._work(f"q {first}", sum(work.shape[1] * r for _, _, work, r in matrices), torch.float32, device)
            qts, at = [], 0
            for (_, _, work, rank), pt in zip(matrices, pts):
                # Orthonormal columns of P: its scale cancels, so the sum over ranks needs no division.
                pt.copy_(torch.linalg.qr(pt.t()).Q.t())
                qt = q_all[at : at + work.shape[1] * rank].view(rank, work.shape[1])
                torch.mm(pt, work, out=qt)
                qts.append(qt)
                at += qt.numel()
            self.stats.sent_bytes += q_all.numel() * q_all.element_size()
            reducing = dist.all_reduce(q_all, group=self.process_group, async_op=True)
            self.stats.encode_s += time.perf_counter() - started
            yield
            reducing.wait()
            started = time.perf_counter()
            q_all.div_(self.world_size)
            for (key, matrix, work, _), pt, qt in zip(matrices, pts, qts):
                self.factors_qt[key] = qt.clone()  # the warm start of the next step
                # What this rank did not get across: its gradient (with last step's error) minus the mean's approximation.
                error = self.errors.get(key)
                if error is None or error.shape != work.shape:
                    error = self.errors[key] = torch.empty_like(work)
                torch.addmm(work, pt.t(), qt, alpha=-1, out=error)
                if work is matrix:
                    torch.mm(pt.t(), qt, out=matrix)
                else:
                    matrix.copy_(pt.t() @ qt)
            self.stats.decode_s += time.perf_counter() - started
        elif plain_work:
            yield
        for reducing, dtype, tensors in plain_work:
            reducing.wait()
            self._unpack(f"plain {dtype} {first}", tensors)

    def _qt(self, key: str, columns: int, rank: int, device: torch.device) -> torch.Tensor:
        """Q of a matrix, transposed (rank x columns)."""
        qt = self.factors_qt.get(key)
        if qt is None or qt.shape != (rank, columns) or qt.device != device:
            generator = torch.Generator().manual_seed(zlib.crc32(key.encode()))
            qt = self.factors_qt[key] = torch.randn(columns, rank, generator=generator).t().contiguous().to(device)
        return qt

    def _work(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat work tensor of this hook's, reused every step (fresh ones cost page faults on the CPU)."""
        tensor = self._packed.get(name)
        if tensor is None or tensor.numel() < numel or tensor.dtype != dtype or tensor.device != device:
            tensor = self._packed[name] = torch.empty(numel, dtype=dtype, device=device)
        return tensor[:numel]

    def _pack(self, name: str, tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        flat = self._work(name, sum(t.numel() for t in tensors), dtype, tensors[0].device)
        at = 0
        for tensor in tensors:
            flat[at : at + tensor.numel()].copy_(tensor.reshape(-1))
            at += tensor.numel()
        return flat

    def _unpack(self, name: str, tensors: list[torch.Tensor]) -> None:
        flat, at = self._packed[name], 0
        for tensor in tensors:
            tensor.copy_(flat[at : at + tensor.numel()].view_as(tensor))
            at += tensor.numel()

    def start(self, planned_steps: int | None) -> None:
        if self.config.powersgd_start_step is None:
            self.start_step = max(2, (planned_steps or 0) // 10)

    def state_dict(self) -> dict[str, Any]:
        # Q is saved as the paper writes it (columns x rank), whatever the layout kept in memory.
        saved = {"error": self.errors, "q": {key: qt.t() for key, qt in self.factors_qt.items()}}
        parameters = {}
        for key in sorted(set(self.errors) | set(self.factors_qt)):
            parameters[key] = {name: memory[key].detach().to("cpu", copy=True).contiguous()
                               for name, memory in saved.items() if key in memory}
        return {"parameters": parameters, "iter": self.steps, "start_step": self.start_step}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.steps, self.start_step = int(saved["iter"]), int(saved["start_step"])
        self.errors, self.factors_qt = {}, {}
        for key, parts in saved.get("parameters", {}).items():
            if "q" not in parts:
                continue  # a parameter sent uncompressed (an older gradsync kept its zero error)
            q = parts["q"]
            q = q if q.dim() == 2 else q.reshape(-1, self.config.powersgd_rank)
            self.factors_qt[key] = q.t().contiguous()
            if "error" in parts:
                self.errors[key] = parts["error"].reshape(-1, q.shape[0]).clone()


_HOOKS = {"fp16": CastHook, "bf16": CastHook, "int8": Int8Hook, "topk": TopKHook, "powersgd": PowerSGDHook}


def make_hook(config: CompressionConfig, process_group: Any = None) -> CompressionHook | None:
    """The hook for `config`, or None for "none" (DDP's own all-reduce). "auto" is built by
    gradsync.comm.auto.AutoTuner, which needs the trainer's step boundaries."""
    if config.name == "none":
        return None
    if config.name == "auto":
        raise ValueError("compression 'auto' is an AutoTuner (gradsync.comm.auto), not a single hook")
    return _HOOKS[config.name](config, process_group)
