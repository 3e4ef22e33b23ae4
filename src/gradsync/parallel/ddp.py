"""DDP: every rank holds the whole model; gradients are all-reduced in buckets during backward.

It owns DDP's wrapper and everything hung on it: the communication hook that times buckets
(and compresses them), `no_sync()` for accumulation, a by-hand all-reduce for a window whose
boundary batch was skipped, DDP's bucket layout across resumes, and DDP's errors made readable.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import time
from typing import Any, Callable, ContextManager, Iterator

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradsync.agreement import agree_all
from gradsync.bucket_layout import ReadyOrder, rebuilds_buckets, replay, replay_problem
from gradsync.comm.auto import AutoTuner, auto_bucket_cap_mb
from gradsync.comm.compression import make_hook
from gradsync.comm.periodic import PeriodicSync
from gradsync.errors import ConfigError
from gradsync.metrics import CommTimer, StepRecord
from gradsync.parallel.base import Strategy, average_gradients

UNUSED_CHECK_STEPS = 10  # optimizer steps watched to tell whether find_unused_parameters is needed
_UNUSED_INDICES = re.compile(r"Parameter indices which did not receive grad for rank (\d+): ([\d ]+)")


class DDPStrategy(Strategy):
    name = "ddp"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ddp_model: DistributedDataParallel | None = None  # None at world size 1
        self.comm_timer: CommTimer | None = None
        # The gradient-ready order DDP's lasting bucket layout comes from, kept for checkpoints
        # (None: no checkpoints, or a DDP that never changes its layout).
        self.ready_order: ReadyOrder | None = None
        self._model: nn.Module | None = None
        # Steps left to watch which parameters get no gradient (None: not watching).
        self._unused_check_steps: int | None = 0 if self.config.ddp.find_unused_parameters else None
        self._sometimes_unused: set[str] = set()
        self._spans: list[tuple[Any, Any]] = []  # by-hand reductions since the last take_exposed()
        self._reduced_by_hand = 0  # windows whose boundary batch was skipped, reduced by reduce_unsynced
        self.periodic: PeriodicSync | None = None  # ranks step alone and agree every few steps (ddp.periodic)

    def wrap(self, model: nn.Module) -> nn.Module:
        self._model = model
        if self.dist.world_size == 1:
            return model
        options = self.config.ddp
        bucket_cap_mb = options.bucket_cap_mb
        if bucket_cap_mb == "auto":
            bucket_cap_mb = auto_bucket_cap_mb(model)
            self.logger.info(f"bucket_cap_mb='auto': {bucket_cap_mb} MB buckets (its gradient bytes / 30, 1-25 MB)")
        device = self.dist.device
        self.ddp_model = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=bucket_cap_mb,
            find_unused_parameters=options.find_unused_parameters,
            **_buffer_sync_option(options.sync_buffers),
            gradient_as_bucket_view=options.gradient_as_bucket_view,
            static_graph=options.static_graph,
        )
        if options.compression.name == "auto":
            self.compression = AutoTuner(
                options.compression, accumulation_steps=self.config.accumulation_steps, log=self.logger.info
            )
        else:
            self.compression = make_hook(options.compression)
        if self.compression is not None:
            self.compression.bind(model)  # checkpointed hook state is kept by parameter name
        self.comm_timer = CommTimer(self.clock, self.compression or options.comm_hook, options.comm_hook_state)
        self.comm_timer.register(self.ddp_model, process_group=None)
        if self.config.checkpoint.enabled and rebuilds_buckets(options.find_unused_parameters, options.static_graph):
            self.ready_order = ReadyOrder(model)
        if options.periodic.enabled:
            self.periodic = PeriodicSync(options.periodic, model)
            self.logger.info(
                f"periodic synchronisation ({options.periodic.method}): each rank takes {options.periodic.every} optimizer "
                "steps alone, then the ranks agree on one model (and at every epoch's end and checkpoint)"
            )
        return self.ddp_model

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def micro_step(self, synced: bool) -> ContextManager[None]:
        # Forward too, not just backward: DDP decides at forward time whether to reduce.
        if (not synced or self.periodic is not None) and self.ddp_model is not None:
            return self.ddp_model.no_sync()
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def backward(self, record: StepRecord, synced: bool) -> Iterator[None]:
        if self.comm_timer is not None:
            self.comm_timer.start_backward()
        watching = self.ready_order.watch() if synced and self.ready_order is not None else contextlib.nullcontext()
        with watching:
            yield
        if self.comm_timer is not None and (ready := self.comm_timer.last_ready()) is not None:
            # Exposed: from the last bucket ready (compute done) to the end of backward.
            end = self.clock.mark()
            record.exposed.append((ready, end))
            record.comm_windows.append((self.comm_timer.first_ready(), end))

    @property
    def reductions(self) -> int:
        hook_passes = self.comm_timer.reductions if self.comm_timer is not None else 0
        agreements = self.periodic.synchronisations if self.periodic is not None else 0
        return hook_passes + self._reduced_by_hand + agreements

    def reduce_unsynced(self) -> bool:
        """Average accumulated gradients across ranks by hand (a rank without a gradient for a
        parameter contributes zeros)."""
        if self.ddp_model is None or self._model is None or self.periodic is not None:
            return False  # under periodic synchronisation, gradients stay local
        start = self.clock.mark()
        average_gradients([p for p in self._model.parameters() if p.requires_grad], None, self.dist.world_size)
        self._reduced_by_hand += 1
        self._spans.append((start, self.clock.mark()))
        return True

    def take_exposed(self) -> list[tuple[Any, Any]]:
        spans, self._spans = self._spans, []
        return spans

    def comm_counters(self) -> dict[str, float]:
        if self.comm_timer is None:
            return {}
        if self.periodic is not None:
            return {"raw_bytes": self.periodic.sent_bytes, "sent_bytes": self.periodic.sent_bytes}
        if self.compression is None:
            return {"raw_bytes": self.comm_timer.bucket_bytes, "sent_bytes": self.comm_timer.bucket_bytes}
        return self.compression.stats.as_dict()

    def after_update(self) -> None:
        self._note_unused_parameters()
        if self.periodic is not None:
            self._agree(self.periodic.step_done)

    def end_epoch(self) -> None:
        self._end_period()

    def before_checkpoint(self) -> None:
        # One model on every rank, so the checkpoint's single copy of it is every rank's.
        self._end_period()

    def _end_period(self) -> None:
        if self.periodic is not None:
            self._agree(self.periodic.synchronise)

    def _agree(self, synchronise: Callable[[], bool]) -> None:
        start = self.clock.mark()
        if synchronise():
            self._spans.append((start, self.clock.mark()))  # training waited for it: exposed communication

    @property
    def local_optimizer_state(self) -> bool:
        return self.periodic is not None

    def _note_unused_parameters(self) -> None:
        """With find_unused_parameters, say after a few steps whether it is really needed."""
        if self._unused_check_steps is None or self._model is None:
            return
        self._unused_check_steps += 1
        for name, parameter in self._model.named_parameters():
            if parameter.requires_grad and parameter.grad is None:
                self._sometimes_unused.add(name)
        if self._unused_check_steps < UNUSED_CHECK_STEPS:
            return
        self._unused_check_steps = None
        if self._sometimes_unused:
            self.logger.info(
                f"find_unused_parameters is needed: {', '.join(sorted(self._sometimes_unused))} got no gradient "
                f"in some of the first {UNUSED_CHECK_STEPS} steps."
            )
        else:
            self.logger.info(
                f"find_unused_parameters=True, but every parameter got a gradient in each of the first "
                f"{UNUSED_CHECK_STEPS} steps: set it to False to regain overlap, unless some parameters are "
                "skipped only later (DDP raises a clear error then, and gradsync names them)."
            )

    def state_dict(self) -> dict[str, Any]:
        return {
            "compression": self.compression.state_dict() if self.compression is not None else None,
            "ddp_ready_order": self.ready_order.state_dict() if self.ready_order is not None else None,
            "periodic": self.periodic.state_dict() if self.periodic is not None else None,
        }

    def load_state_dict(self, own: dict[str, Any]) -> None:
        if self.compression is not None and own.get("compression") is not None:
            self.compression.load_state_dict(own["compression"])
        if self.periodic is not None and own.get("periodic") is not None:
            self.periodic.load_state_dict(own["periodic"])
        self._restore_bucket_layout(own)

    def _restore_bucket_layout(self, own: dict[str, Any]) -> None:
        """Put DDP in the bucket layout the checkpointed run reduced in (gradsync.bucket_layout),
        so the first step after the resume adds gradients in the same order as that run did."""
        if self.ready_order is None:
            return
        assert self.ddp_model is not None and self.comm_timer is not None
        saved = own.get("ddp_ready_order")
        if saved is None:
            names, problem = None, "the checkpoint holds no record of DDP's bucket order (an older gradsync, or other DDP options)"
        else:
            # No names: the run had not reduced gradients yet, so DDP was still in its first layout, as now.
            names = saved["names"]
            problem = replay_problem(self.ddp_model, names) if names is not None else None
        # The replay is collective (DDP broadcasts rank 0's layout): every rank replays, or none.
        replaying = names is not None and problem is None
        if not agree_all(replaying, group=self.dist.control_group) and replaying:
            problem = "another rank cannot replay it"
        if problem is not None:
            if self.dist.world_size > 2 and self.dist.is_main:
                self.logger.warning(
                    f"DDP's bucket layout is not restored ({problem}): the first step after this resume reduces in "
                    "DDP's first layout, so with 3 or more ranks the parameters differ in the last bits from an "
                    "uninterrupted run."
                )
            return
        if names is None:
            return
        self.ready_order.load_state_dict(saved)
        started = time.perf_counter()
        followed = replay(self.ddp_model, self.ready_order, self.comm_timer.silent)
        if not followed and self.dist.is_main:
            self.logger.warning(
                "DDP's bucket layout was replayed, but its hooks ran in another order than recorded: the layout may "
                "differ from the checkpointed run's, and with 3 or more ranks so may the last bits of the parameters."
            )
        elif followed:
            self.logger.info(f"DDP's bucket layout restored as the checkpointed run had it ({1000 * (time.perf_counter() - started):.0f} ms)")

    def explain(self, error: BaseException) -> Exception | None:
        """DDP's "Expected to have finished reduction" error, with the parameters named.

        DDP gives only parameter indices (names need TORCH_DISTRIBUTED_DEBUG, whose DETAIL
        mode crashes here); the strategy knows the model, so it names them.
        """
        match = _UNUSED_INDICES.search(str(error)) if isinstance(error, RuntimeError) else None
        if match is None or self._model is None:
            return None
        names = [name for name, p in self._model.named_parameters() if p.requires_grad]
        unused = [names[int(i)] for i in match[2].split() if int(i) < len(names)]
        return ConfigError(
            f"on rank {match[1]}, these parameters got no gradient in the previous step: {', '.join(unused)}. "
            "DDP expects every parameter's gradient every step unless told otherwise. Make them take part "
            "in the loss (or freeze them with requires_grad_(False) before prepare()), or pass "
            "ddp={'find_unused_parameters': True}, which costs overlap: DDP then walks the autograd graph "
            "every step and reduces unused parameters' zeros."
        )


def _buffer_sync_option(enabled: bool) -> dict[str, bool]:
    # torch 2.13 renamed DDP's `broadcast_buffers` to `forward_sync_buffers` (and warns on the
    # old name); both mean "sync buffers before every forward".
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": enabled}
    return {"broadcast_buffers": enabled}
