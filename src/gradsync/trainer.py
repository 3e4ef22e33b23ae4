"""The training-loop core: one model, one optimizer, micro-steps and optimizer steps.

A user keeps their own loop; the trainer supplies the parts that are easy to get subtly wrong
in data-parallel training:

- gradients are all-reduced once per optimizer step: every micro-step but a window's last runs
  its forward *and* backward under DDP's `no_sync()`;
- each micro-batch's loss is weighted by its share of the window's samples, so accumulated
  gradients equal those of one big batch, the short last window of an epoch included;
- mixed precision: autocast, fp16 loss scaling, gradients unscaled before clipping, and
  steps skipped on overflow or non-finite gradients counted and logged;
- ranks that agree to skip a batch (`agree_any`) stay in step, even when the skipped batch was
  the one that should have reduced the gradients;
- per-step metrics, including the gradient communication backward did not hide.

Data flows top to bottom: `prepare` wraps the model and builds the loader, `epochs` sets each
epoch, `step` opens a micro-step whose exit runs the optimizer at a window's boundary.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import time
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradsync import compat, events
from gradsync.accumulation import AccumulationPlan, Window, plan_window
from gradsync.agreement import agree_all, agree_any, raise_if_any_rank_failed
from gradsync.comm.auto import AutoTuner
from gradsync.config import TrainerConfig
from gradsync.data import DistributedLoader, EvalLoader
from gradsync.distributed import collective_device, join_process_group, lone_process_group, plan_distributed, shutdown
from gradsync.errors import ConfigError, GradsyncError
from gradsync.host_memory import reuse_freed_memory, wants_reuse
from gradsync.log import configure_logging
from gradsync.profiling.breakdown import format_breakdown
from gradsync.profiling.capture import ProfileWindow, parse_profile_steps, phase
from gradsync.metrics import Clock, MetricsRecorder, StepRecord
from gradsync.parallel import make_strategy
from gradsync.parallel.base import step_mixed_groups_one_by_one
from gradsync import rundir
from gradsync.rundir.records import METRICS_KEYS
from gradsync.precision import MixedPrecision, check_precision_supported
from gradsync.seeding import rank_seed, rng_state, seed_everything, set_rng_state

if TYPE_CHECKING:
    from gradsync.checkpoint.checkpointer import Loaded, RunState

# Beyond this many, skipped steps are only counted (metrics, summary), not logged one by one.
_SKIPS_LOGGED = 10


class Trainer:
    """Distributed training around the user's own loop. Build it with `gradsync.setup()`."""

    def __init__(self, config: TrainerConfig) -> None:
        self._config = config
        planned = plan_distributed(config.device, config.backend)
        if config.parallel.sharded:
            # FSDP2 and DTensor build their meshes on a process group, even alone: a lone
            # `python train.py` gets a one-rank group, so its checkpoints are sharded ones that
            # a launched job of any size resumes (resharded).
            planned = lone_process_group(planned, config.backend)
        check_precision_supported(config.precision, planned.device)
        self._dist = join_process_group(planned, config.timeout_s)
        self._logger = configure_logging(self._dist.rank)
        if self.is_main:
            for note in compat.check(compat.TRAINER):
                self._logger.warning(note)
        # Where freed host memory goes back to the OS, an update's gradients are freed at the next
        # backward, not at once (_release_spent_gradients says why).
        self._release_gradients_at_backward = self.device.type == "cpu" and not self._apply_host_memory()
        self._closed = False
        atexit.register(self._leave_at_exit)
        with self._failing_together():
            self._run_dir = self._check_options_and_choose_run_dir()
        seed_everything(config.seed)
        self._clock = Clock(self._dist.device)
        with self._failing_together():
            self._strategy = make_strategy(config.parallel.strategy, config, self._dist, self._clock, self._logger)
        # FSDP casts to bf16 through its own policy (parameters gathered in bf16), not autocast.
        # A pipeline's ranks hold different parameters: they skip an overflowing step together.
        self._precision = MixedPrecision(config.precision if self._strategy.autocast else "fp32", self._dist.device,
                                         agree_on_overflow=config.parallel.pipeline and self._dist.has_process_group)
        self._metrics = MetricsRecorder(
            config.metrics,
            self._clock,
            rank=self._dist.rank,
            world_size=self._dist.world_size,
            distributed=self._dist.has_process_group,
            control_group=self._dist.control_group,
            run_dir=self._run_dir,
            logger=self._logger,
            gpu_uuid=_gpu_uuid(self._dist.device),
        )
        events.claim_steps()  # steps are optimizer steps (gradsync run's --inject-fault counts them)
        self._checkpointer: Checkpointer | None = None
        if config.checkpoint.enabled:
            # Imported here: torch.distributed.checkpoint takes ~0.8 s to import, which only runs
            # that checkpoint should pay.
            from gradsync.checkpoint.checkpointer import Checkpointer

            self._checkpointer = Checkpointer(
                config.checkpoint,
                rank=self.rank,
                world_size=self.world_size,
                group=self._dist.control_group,
                distributed=self._dist.has_process_group,
                log=self._logger.info,
                warn=self._logger.warning,
                description=config.describe(),
            )
            with self._failing_together():
                foreign, refused = self._checkpointer.foreign_checkpoints()
                raise_if_any_rank_failed(refused, self._dist.control_group)
            if config.checkpoint.overwrite:
                self._checkpointer.remove(foreign)
        self._tracked: dict[str, Any] = {}  # the user's objects saved with each checkpoint
        self._resumed: Loaded | None = None  # what a resume loaded, for parts attached later
        self._resumed_param_groups: list[dict[str, Any]] = []
        self._first_epoch = 0  # where the next epochs() loop starts (a resumed run's epoch)
        self._model: nn.Module | None = None  # the user's module (sharded in place under FSDP/TP)
        self._wrapped: nn.Module | None = None  # what the loop calls: the DDP wrapper, or the model
        self._optimizer: torch.optim.Optimizer | None = None
        self._scheduler: Any = None
        self._loader: DistributedLoader | None = None
        self._comm_at_start: dict[str, float] = {}
        self._optimizer_steps = 0  # accumulation windows closed, whether the update was applied or skipped
        # Micro-batches per step: the configured count, unless auto raised it (if allowed).
        self._accumulation = AccumulationPlan(config.accumulation_steps)
        self._num_epochs: int | None = None  # the running epochs() loop's length (for re-planning)
        self._profile: ProfileWindow | None = None  # metrics.profile_steps, opened when training starts
        self._profiled = False  # the window was written (or training ended inside it): once per run
        self._window: Window | None = None  # the window being accumulated
        self._record: StepRecord | None = None  # its metrics
        self._finished: StepRecord | None = None  # the last closed step, still open to log()
        self._reductions_at_start = 0
        self._micro_samples = 0  # samples in the latest micro-batch (weight of log() values)
        self._last_micro_step: tuple[int, int] | None = None  # (loader pass, batch index)
        self._last_step_end: Any = None
        self._skips_logged = 0
        self._gradients_spent = False  # the last update's gradients are still held (see _release_spent_gradients)
        self._started = time.time()
        self._describe_run()
        self._logger.info(
            f"world size {self.world_size} | backend {self._dist.backend or 'none (single process)'}"
            f" | parallel {config.parallel.strategy} | device {self.device} | precision {config.precision}"
            f" | accumulation {config.accumulation_steps} | run dir {self._run_dir}"
        )

    # -- where this process stands -------------------------------------------------------

    @property
    def rank(self) -> int:
        return self._dist.rank

    @property
    def world_size(self) -> int:
        return self._dist.world_size

    @property
    def device(self) -> torch.device:
        return self._dist.device

    @property
    def is_main(self) -> bool:
        return self._dist.is_main

    @property
    def resumed_from(self) -> Path | None:
        """The checkpoint folder this run resumed from (its name gives the step), None when it
        started fresh."""
        return self._resumed.path if self._resumed is not None else None

    @property
    def run_dir(self) -> Path:
        """Where metrics, profiles and (under `gradsync run`) the diagnosis and logs go."""
        return self._run_dir

    @property
    def optimizer_steps(self) -> int:
        """Accumulation windows closed so far, whether the update was applied or skipped."""
        return self._optimizer_steps

    # -- setting up ------------------------------------------------------------------------

    def _apply_host_memory(self) -> bool:
        """`host_memory`: on CPU training, keep the host memory a step frees for the next one.
        True if it is kept."""
        setting = self._config.host_memory
        if not wants_reuse(setting, self.device.type):
            return False
        applied = reuse_freed_memory()
        if not self.is_main:
            return applied is not None
        if applied is None:
            if setting == "reuse":
                self._logger.warning(
                    "host_memory='reuse' changes nothing here: the C library is not glibc. Preloading jemalloc "
                    "or tcmalloc (LD_PRELOAD) keeps freed memory for reuse on any C library."
                )
            return False
        self._logger.info(
            f"host_memory={setting!r}: host memory a step frees stays in each process for the next step ({applied}); "
            "host_memory='release' keeps the C library's defaults"
        )
        return True

    def _check_options_and_choose_run_dir(self) -> Path:
        """Check every rank got the same options and take rank 0's run directory.

        Ranks started with different options would diverge silently (or hang) later; here it
        costs one small gather at start-up and fails on every rank with the differing fields.
        The folder follows gradsync.rundir's one rule: under `gradsync run`, the launcher's.
        """
        chosen, overruled = rundir.choose(self._config.run_dir)
        if overruled and self.is_main:
            self._logger.warning(overruled)
        proposal = str(chosen)  # rank 0's is taken below: a fresh name could differ by a second
        description = self._config.describe()
        if self._dist.has_process_group and self.world_size > 1:
            reports: list[Any] = [None] * self.world_size
            dist.all_gather_object(reports, (description, proposal), group=self._dist.control_group)
            differing = sorted(
                key for key in description if any(r[0][key] != description[key] for r in reports)
            )
            if differing:
                details = "; ".join(
                    f"{key}: " + ", ".join(f"rank {r}={rep[0][key]!r}" for r, rep in enumerate(reports))
                    for key in differing
                )
                raise ConfigError(
                    f"ranks were started with different options ({details}). Every rank must "
                    "run the same configuration; check rank-dependent arguments or environment."
                )
            proposal = reports[0][1]
        run_dir = Path(proposal)
        if self.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
        return run_dir

    def prepare(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        dataset: Any,
        *,
        batch_size: int,
        shuffle: bool = True,
        remainder: str = "pad",
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_workers: int = 0,
    ) -> tuple[nn.Module, torch.optim.Optimizer, DistributedLoader]:
        """Spread `model` over the ranks (`parallel`) and build this rank's loader over `dataset`.

        `batch_size` is per data-parallel rank and per micro-step: an optimizer step sees
        batch_size x accumulation_steps x data-parallel ranks samples (ranks of one
        tensor-parallel group share their batches). `remainder` says what happens to samples
        that do not divide by the data-parallel ranks ("pad" repeats a few, "drop" leaves them
        out).

        Returns the model to call in the loop (DDP-wrapped when world size > 1 under DDP;
        sharded in place under FSDP and tensor parallelism), the optimizer (the same object,
        now holding the sharded parameters when they were replaced) and the loader. Checks run
        on every rank and fail on every rank together.
        """
        if self._closed:
            raise GradsyncError(
                "this trainer is closed (by close(), or by an error every rank raised); start "
                "again with gradsync.setup()."
            )
        if self._model is not None:
            raise GradsyncError("prepare() was already called: one trainer trains one model.")
        error: GradsyncError | None = None
        loader = None
        try:
            self._check_model_and_optimizer(model, optimizer)
            placement = self._strategy.placement
            loader = DistributedLoader(
                dataset,
                batch_size,
                rank=placement.data_rank,
                world_size=placement.data_world_size,
                device=self.device,
                seed=self._config.seed,
                shuffle=shuffle,
                remainder=remainder,
                collate_fn=collate_fn,
                num_workers=num_workers,
            )
        except GradsyncError as exc:
            error = exc
        with self._failing_together():
            raise_if_any_rank_failed(error, self._dist.control_group)
            if self.world_size > 1:
                self._check_same_model_on_every_rank(model)
        assert loader is not None
        names = {id(p): name for name, p in model.named_parameters()}
        self._wrapped = self._strategy.wrap(model)
        # What this rank trains: the user's module, sharded in place (FSDP, TP), or its stages (pipelines).
        model = self._strategy.trained_module(self._wrapped)
        _rebind_optimizer(optimizer, names, dict(model.named_parameters()))
        mixed = step_mixed_groups_one_by_one(optimizer)
        if mixed and self.is_main:
            self._logger.info(
                f"optimizer param group(s) {mixed} hold DTensors beside plain tensors ({self._strategy.name} "
                "left some layers unsplit); they step parameter by parameter (foreach=False), since torch's "
                "multi-tensor kernels refuse the mix"
            )
        self._model, self._optimizer, self._loader = model, optimizer, loader
        # Every rank started from the same seed so models are built equal; from here on each
        # data-parallel rank draws its own stream, so dropout masks differ across replicas as
        # they would across the samples of one big batch (and agree within a tensor-parallel group).
        seed_everything(rank_seed(self._config.seed, self._strategy.placement.data_rank))
        if self._checkpointer is not None:
            with self._failing_together():
                self._resume()
            loader.before_batch = self._save_if_due
        return self._wrapped, optimizer, loader

    def _check_model_and_optimizer(self, model: Any, optimizer: Any) -> None:
        if isinstance(model, DistributedDataParallel) or _is_sharded(model):
            raise ConfigError(
                "pass the plain model to prepare(); gradsync wraps or shards it itself (choose how with "
                "setup(parallel=...))."
            )
        if not isinstance(model, nn.Module):
            raise ConfigError(f"prepare() expects an nn.Module as the model, got {type(model).__name__}.")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"prepare() expects a torch.optim.Optimizer, got {type(optimizer).__name__}."
            )
        if not any(p.requires_grad for p in model.parameters()):
            raise ConfigError("the model has no parameter that requires a gradient: nothing to train.")
        for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
            for name, tensor in named:
                if not _same_device(tensor.device, self.device):
                    raise ConfigError(
                        f"model {kind} '{name}' is on {tensor.device} but this rank trains on "
                        f"{self.device}; call model.to(trainer.device) before prepare()."
                    )
        owned = {id(p) for p in model.parameters()}
        for group in optimizer.param_groups:
            if any(id(p) not in owned for p in group["params"]):
                raise ConfigError(
                    "the optimizer holds parameters that are not the model's (was it built for "
                    "another copy of the model?). Build it from model.parameters() of the model "
                    "you pass to prepare()."
                )
        if self._config.parallel.sharded and optimizer.state:
            raise ConfigError(
                f"the optimizer already holds state (it has stepped), and parallel={self._config.parallel.strategy!r} "
                "replaces the model's parameters with sharded ones. Build the optimizer fresh before prepare(), and "
                "resume from a checkpoint to continue a run."
            )

    def _check_same_model_on_every_rank(self, model: nn.Module) -> None:
        layout = [(name, tuple(p.shape), str(p.dtype)) for name, p in model.named_parameters()]
        layouts: list[Any] = [None] * self.world_size
        dist.all_gather_object(layouts, layout, group=self._dist.control_group)
        for rank, other in enumerate(layouts):
            if other != layouts[0]:
                detail = next(
                    (f"'{a[0]}' {a[1]} {a[2]} on rank 0 vs '{b[0]}' {b[1]} {b[2]} on rank {rank}"
                     for a, b in zip(layouts[0], other) if a != b),
                    f"{len(layouts[0])} parameters on rank 0 vs {len(other)} on rank {rank}",
                )
                raise ConfigError(
                    f"the model differs across ranks ({detail}). Every rank must build the same "
                    "model; check rank-dependent code in its construction."
                )

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in the current epoch (the last accumulation window may be short).

        The same in every epoch, unless auto raised the accumulation (only when allowed by
        `compression.max_accumulation_steps`): then later epochs have fewer.
        """
        loader = self._require_prepared("steps_per_epoch")
        return self._accumulation.windows(loader.epoch, len(loader))

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step of the window being accumulated, else of the next
        one (auto may have raised it from the configured count)."""
        loader = self._require_prepared("accumulation_steps")
        batch = self._window.first_batch if self._window is not None else loader.position
        return self._accumulation.steps_at(loader.epoch, batch)

    def _steps_in_epochs(self, num_epochs: int) -> int:
        loader = self._require_prepared("epochs()")
        return sum(self._accumulation.windows(epoch, len(loader)) for epoch in range(num_epochs))

    def set_scheduler(self, scheduler: Any) -> None:
        """Step this learning-rate scheduler once per applied optimizer step.

        A step skipped for overflow or non-finite gradients does not advance the schedule.
        Build it after prepare() when it needs the run's length: epochs x steps_per_epoch.
        """
        self._require_prepared("set_scheduler()")
        if getattr(scheduler, "optimizer", None) is not self._optimizer:
            raise ConfigError(
                "the scheduler does not drive the optimizer passed to prepare(); build it from "
                "that optimizer."
            )
        self._scheduler = scheduler
        if self._resumed is not None and self._resumed.shared["scheduler"] is not None:
            scheduler.load_state_dict(self._resumed.shared["scheduler"])
            # Building the scheduler just set the optimizer's learning rate to its first value;
            # put back the one the checkpointed step left for the next.
            for group, saved in zip(self._optimizer.param_groups, self._resumed_param_groups):
                group.update({key: value for key, value in saved.items() if key != "params"})

    # -- checkpoints -------------------------------------------------------------------------

    def register_for_checkpointing(self, **objects: Any) -> None:
        """Save these objects (anything with `state_dict()` and `load_state_dict()`) with every
        checkpoint, per rank, and restore them on resume, e.g. `register_for_checkpointing(ema=ema)`.

        Model, optimizer, scheduler, loss scaler, loader position, random streams and compression
        state are saved without asking.
        """
        for name, obj in objects.items():
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise ConfigError(
                    f"register_for_checkpointing({name}=...): a {type(obj).__name__} has no "
                    "state_dict()/load_state_dict(); wrap its state in an object that has them."
                )
            self._tracked[name] = obj
            saved = (self._resumed.own or {}).get("tracked", {}) if self._resumed is not None else {}
            if name in saved:
                obj.load_state_dict(saved[name])

    def save_checkpoint(self) -> None:
        """Save now, between two optimizer steps (collective: every rank calls it)."""
        if self._checkpointer is None:
            raise ConfigError("save_checkpoint() needs a checkpoint folder: setup(checkpoint={'dir': ...}).")
        if self._window is not None:
            raise GradsyncError(
                "save_checkpoint() was called in the middle of an accumulation window; call it after "
                "the step that ends a window (e.g. at the end of an epoch), so no gradients are lost."
            )
        self._checkpointer.save(self._optimizer_steps, self._run_state())

    def _save_if_due(self, epoch_done: bool = False) -> None:
        if self._checkpointer is not None:
            self._checkpointer.save_if_due(lambda: self._run_state(epoch_done))

    def _run_state(self, epoch_done: bool = False) -> RunState:
        """What a checkpoint holds: the model's tensors, state equal on every rank, this rank's own.

        `epoch_done`: taken after an epoch's own end-of-epoch code (evaluation) ran, so a resumed
        run starts with the next epoch instead of running that code again.
        """
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        from gradsync.checkpoint.checkpointer import model_state

        assert self._model is not None and self._optimizer is not None and self._loader is not None
        self._strategy.before_checkpoint()
        loader_state = self._loader.state_dict()
        if epoch_done:
            loader_state.update(epoch=loader_state["epoch"] + 1, position=0, epoch_start=0, samples_consumed=0)
        optimizer = get_optimizer_state_dict(self._model, self._optimizer)
        shared = {
            "optimizer_steps": self._optimizer_steps,
            "scheduler": self._scheduler.state_dict() if self._scheduler is not None else None,
            "scaler": self._precision.scaler.state_dict() if self._precision.scaler is not None else None,
            "loader": loader_state,
        }
        own = {
            "rng": rng_state(),
            **self._strategy.state_dict(),
            "accumulation": self._accumulation.state_dict(),
            "metrics": self._metrics.state_dict(pending=self._finished),
            "tracked": {name: obj.state_dict() for name, obj in self._tracked.items()},
            # Ranks that step alone between agreements (ddp.periodic) each have their own optimizer state.
            "optimizer": optimizer if self._strategy.local_optimizer_state else None,
        }
        # A sharded optimizer state (DTensors) is written by every rank, each its shards.
        if self._strategy.sharded:
            return model_state(self._model, shared, own, sharded={"optimizer": optimizer})
        # A pipeline's is kept per parameter, by the ranks that hold it; each stage's first copy writes its buffers.
        if self._strategy.staged:
            return model_state(self._model, shared, own, staged=_per_parameter(optimizer),
                               writes_buffers=self._strategy.placement.data_rank == 0)
        return model_state(self._model, {**shared, "optimizer": optimizer}, own)

    def _resume(self) -> None:
        """Load the checkpoint `checkpoint.resume` names, if any, into every part of the run."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        from gradsync.checkpoint.checkpointer import model_state

        assert self._checkpointer is not None and self._model is not None and self._loader is not None
        # Sharded optimizer state loads into tensors laid out as this run's (DCP reshards).
        model, optimizer = self._model, self._optimizer
        sharded = (lambda: {"optimizer": get_optimizer_state_dict(model, optimizer)}) if self._strategy.sharded else None
        staged = [name for name, _ in model.named_parameters()] if self._strategy.staged else None
        loaded = self._checkpointer.find_and_load(model_state(self._model), sharded, staged)
        if loaded is None:
            return
        shared = loaded.shared
        if self._strategy.staged:
            optimizer = _from_per_parameter(loaded.staged, get_optimizer_state_dict(model, self._optimizer))
        else:
            optimizer = loaded.sharded["optimizer"] if self._strategy.sharded else shared["optimizer"]
        if loaded.own is not None and loaded.own.get("optimizer") is not None:
            optimizer = loaded.own["optimizer"]  # ranks that stepped alone (ddp.periodic) each saved their own
        set_optimizer_state_dict(self._model, self._optimizer, optimizer)
        self._resumed_param_groups = optimizer["param_groups"]  # for a scheduler attached later
        if shared["scaler"] is not None and self._precision.scaler is not None:
            self._precision.scaler.load_state_dict(shared["scaler"])
        self._optimizer_steps = shared["optimizer_steps"]
        self._loader.load_state_dict(shared["loader"])
        self._first_epoch = self._loader.epoch
        if loaded.own is not None:
            set_rng_state(loaded.own["rng"])
            self._restore_accumulation(loaded.own.get("accumulation"))
            self._strategy.load_state_dict(loaded.own)
            self._finished = self._metrics.load_state_dict(loaded.own["metrics"])
        else:
            self._logger.warning(self._world_size_change_note(loaded))
        self._resumed = loaded

    def _restore_accumulation(self, saved: dict[str, Any] | None) -> None:
        """Take back the accumulation auto raised before the checkpoint (checkpoints of runs
        without auto hold only the configured count)."""
        if saved is None or saved["raised_to"] is None:
            return
        if saved["steps"] != self._config.accumulation_steps:
            self._logger.warning(
                f"the checkpoint's run accumulated {saved['steps']} micro-batches per step (auto raised it to "
                f"{saved['raised_to']}); this run is configured with {self._config.accumulation_steps} and keeps that."
            )
            return
        self._accumulation.load_state_dict(saved)

    def _world_size_change_note(self, loaded: Loaded) -> str:
        assert self._loader is not None
        saved = loaded.shared["loader"]
        written = loaded.manifest["world_size"]
        change = (
            f"the checkpoint was written by {written} ranks, this run has {self.world_size}" if written != self.world_size
            else f"the checkpoint was written with parallel={loaded.manifest['config']['parallel']['strategy']!r}, this "
                 f"run uses {self._strategy.name!r} (over {self._strategy.placement.data_world_size} data-parallel ranks)"
        )
        return (
            f"{change}: epoch {saved['epoch']} goes on from global sample {saved['samples_consumed']} "
            f"of {saved['dataset_size']}, the rest of its order re-divided ({self._loader.samples_per_rank} per rank), "
            "so no sample of the epoch is skipped or repeated. Not bitwise equal to an uninterrupted run: the "
            "global batch is now batch_size x accumulation x world size, per-rank random streams restart "
            "from the seed and gradient-compression residuals start from zero."
        )

    # -- the loop ------------------------------------------------------------------------

    def epochs(self, num_epochs: int) -> Iterator[int]:
        """Yield epoch numbers, setting the loader's shuffle for each one.

        At the end of an epoch, a window whose last batches were skipped still gets its
        optimizer step; after the last epoch, buffered metrics are written.
        """
        loader = self._require_prepared("epochs()")
        if not isinstance(num_epochs, int) or num_epochs < 0:
            raise ConfigError(f"epochs({num_epochs!r}): use a non-negative integer.")
        self._num_epochs = num_epochs
        self._metrics.progress.set_total(self._steps_in_epochs(num_epochs))
        resumed_compression = self._resumed is not None and self._resumed.own is not None
        compression = self._strategy.compression
        if compression is not None and not resumed_compression:
            compression.start(self._optimizer_steps + self._steps_in_epochs(num_epochs))
        # A resumed run goes on in the epoch it stopped in (which may have no batch left: its
        # end-of-epoch code, such as evaluation, still runs).
        first, self._first_epoch = self._first_epoch, 0
        self._open_profile_window()
        for epoch in range(first, num_epochs):
            loader.set_epoch(epoch)
            self._last_step_end = self._clock.mark()  # time between epochs (evaluation) is not a step
            yield epoch
            if self._window is not None:
                self._close_window(reduced=False)
            self._commit_finished()
            self._save_if_due(epoch_done=True)
        self._metrics.flush()
        self._close_profile_window()

    def _open_profile_window(self) -> None:
        steps = self._config.metrics.profile_steps
        if steps is None or self._profile is not None or self._profiled:
            return
        first, last = parse_profile_steps(steps)
        first = max(first, self._optimizer_steps + 1)  # a resumed run may start inside the window
        if first > last:
            self._profiled = True  # ... or past it
            return
        # Opened here, not at setup: a window from step 1 would otherwise also record prepare().
        self._profile = ProfileWindow(first, last, self._run_dir, self.rank)
        if self._optimizer_steps and first == self._optimizer_steps + 1:
            self._profile.step_finished(self._optimizer_steps)  # starts recording now

    def _close_profile_window(self) -> None:
        window = self._profile
        if window is None:
            return
        window.close()
        self._profile, self._profiled = None, True
        if window.breakdown is not None and self.is_main:
            self._logger.info(f"profile of steps {self._config.metrics.profile_steps} (rank 0; trace in "
                             f"{window.trace_path.parent}):\n{format_breakdown(window.breakdown)}")

    def step(self) -> "MicroStep":
        """Open the micro-step for the batch just taken from the loader.

        Use it as `with trainer.step() as step: ... step.backward(loss)`. A micro-step whose
        body never calls `step.backward` counts as skipped (take that decision with
        `agree_any` so every rank skips together).
        """
        loader = self._require_prepared("step()")
        if not loader.in_epoch:
            raise GradsyncError(
                "trainer.step() belongs inside `for batch in loader:` over the loader returned by "
                "prepare(); it takes its place in the accumulation window from the loader."
            )
        here = (loader.pass_id, loader.position - 1)
        if here == self._last_micro_step:
            raise GradsyncError(
                "trainer.step() was opened twice for the same batch; open one micro-step per batch."
            )
        self._last_micro_step = here
        if self._window is not None and not self._window.contains(*here):
            # The window's boundary batch was skipped: its gradients still await reduction.
            self._close_window(reduced=False)
        if self._window is None:
            self._open_window(*here)
        window = self._window
        assert window is not None
        self._micro_samples = loader.batch_size_at(here[1])
        return MicroStep(self, self._micro_samples, is_boundary=here[1] == window.last_batch)

    def _open_window(self, pass_id: int, batch_index: int) -> None:
        assert self._loader is not None
        self._commit_finished()
        steps = self._accumulation.steps_at(self._loader.epoch, batch_index)
        self._window = plan_window(pass_id, batch_index, len(self._loader), steps, self._loader.batch_size_at)
        start = self._last_step_end if self._last_step_end is not None else self._clock.mark()
        self._record = StepRecord(step=self._optimizer_steps + 1, epoch=self._loader.epoch, start=start)
        self._reductions_at_start = self._strategy.reductions
        self._comm_at_start = self._strategy.comm_counters()
        self._strategy.start_window(self._record.step)

    def _backward(self, loss: torch.Tensor, samples: int, synced: bool) -> None:
        window, record = self._window, self._record
        assert window is not None and record is not None
        weight = window.weight(samples)
        self._release_spent_gradients()
        with phase("backward"), self._strategy.backward(record, synced):
            self._precision.backward(loss if weight == 1.0 else loss * weight)
        window.applied_samples += samples

    def _release_spent_gradients(self) -> None:
        """Free the gradients the last update used (once; the next backward makes new ones).

        Freed right after the update, they are not held through the next forward, which keeps
        its peak lower: the trainer does so where freed memory stays in the process (CUDA's
        caching allocator, host_memory="reuse"). Where the C library gives freed memory back to
        the OS (CPU training under host_memory="release", glibc's defaults), it frees them here,
        just before the next backward, as PyTorch's own loop (`zero_grad(); backward(); step()`)
        does: freed after the update, they joined the activations the backward had just freed
        at the heap's top, glibc returned it all to the OS, and the next step faulted it back in
        (ResNet-18, 2 workers: 29,500 faults a step against 5,200, and 5% slower; the trainer's
        jobs faulted 2-3x as often as a plain DDP loop under the same allocator).
        """
        if self._gradients_spent and self._optimizer is not None:
            self._gradients_spent = False
            with phase("optimizer"):
                self._optimizer.zero_grad(set_to_none=True)

    def _pipeline_backward(self, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor], samples: int) -> torch.Tensor:
        """The schedule's forwards and backwards of one batch (gradsync.parallel.pp)."""
        window, record = self._window, self._record
        assert window is not None and record is not None
        scale = self._precision.loss_scale()
        self._release_spent_gradients()
        with phase("backward"):
            loss = self._strategy.forward_backward(inputs, targets, loss_fn, window.weight(samples), scale)
        window.applied_samples += samples
        return loss

    def _close_window(self, reduced: bool) -> bool:
        """Reduce (if DDP did not), clip and step the optimizer; True if an update was applied."""
        window, record = self._window, self._record
        assert window is not None and record is not None and self._optimizer is not None and self._loader is not None
        self._window = self._record = None
        self._optimizer_steps += 1
        applied = False
        if window.applied_samples == 0:
            record.skipped = "empty"
        else:
            if not reduced:
                self._strategy.reduce_unsynced()
            with phase("optimizer"):
                applied = self._apply_update(window, record)
            self._strategy.after_update()
        if window.last_batch == len(self._loader) - 1:
            self._strategy.end_epoch()
        self._gradients_spent = True
        if not self._release_gradients_at_backward:
            self._release_spent_gradients()
        record.exposed.extend(self._strategy.take_exposed())
        record.exposed_estimate_s = self._strategy.exposed_estimate_s()
        record.samples = window.applied_samples if self._strategy.placement.counts_samples else 0
        record.reductions = self._strategy.reductions - self._reductions_at_start
        record.comm = {k: v - self._comm_at_start.get(k, 0) for k, v in self._strategy.comm_counters().items()}
        record.lr = self._optimizer.param_groups[0].get("lr")
        record.end = self._clock.mark()
        self._last_step_end = record.end
        tuner = self._strategy.compression
        if isinstance(tuner, AutoTuner) and tuner.deciding:
            tuner.step_done(self.device, record.exposed_seconds(self._clock))
            if not tuner.deciding and tuner.accumulation_steps > self._accumulation.steps:
                self._raise_accumulation(tuner.accumulation_steps, next_batch=window.last_batch + 1)
        self._finished = record
        events.optimizer_step(self._optimizer_steps)
        if self._profile is not None:
            self._profile.step_finished(self._optimizer_steps)
            if not self._profile.recording and self._profile.breakdown is not None:
                self._close_profile_window()
        if self._checkpointer is not None:
            self._checkpointer.after_step(self._optimizer_steps)
        return applied

    def _raise_accumulation(self, steps: int, next_batch: int) -> None:
        """Apply auto's larger accumulation from the next batch where such a window can start,
        and re-plan what was planned from the old steps per epoch."""
        loader = self._require_prepared("step()")
        epoch, before = loader.epoch, self._accumulation.steps
        self._accumulation.raise_to(steps, epoch, next_batch, len(loader))
        where = (f"batch {self._accumulation.from_batch} of epoch {epoch}" if self._accumulation.from_epoch == epoch
                 else f"epoch {self._accumulation.from_epoch}")
        per_micro_batch = loader.batch_size * self.world_size
        self._logger.info(
            f"accumulation {before} -> {steps} micro-batches per optimizer step from {where}: the global batch grows "
            f"from {before * per_micro_batch} to {steps * per_micro_batch} samples, a full epoch from "
            f"{math.ceil(len(loader) / before)} to {math.ceil(len(loader) / steps)} optimizer steps. The learning rate "
            "is left as it is."
        )
        if self._num_epochs is not None:
            self._metrics.progress.set_total(self._steps_in_epochs(self._num_epochs))
        if self._scheduler is not None:
            self._logger.warning(
                f"the learning-rate scheduler was set before auto raised accumulation; if its length came from "
                f"steps_per_epoch, it now ends before reaching its end (the run has {self._metrics.progress.total_steps} "
                "optimizer steps now). With a schedule whose length matters (OneCycleLR, cosine), set "
                "accumulation_steps yourself instead of letting auto raise it."
            )

    def _apply_update(self, window: Window, record: StepRecord) -> bool:
        assert self._optimizer is not None and self._model is not None
        self._precision.unscale_(self._optimizer)
        if window.applied_samples != window.planned_samples:
            # Skipped micro-batches: rescale so the applied ones carry the whole window's weight.
            correction = window.correction()
            for p in self._model.parameters():
                if p.grad is not None:
                    p.grad.mul_(correction)
        grads_finite = True
        if self._config.max_grad_norm is not None:
            record.grad_norm = self._strategy.clip_grad_norm(list(self._model.parameters()), self._config.max_grad_norm)
            grads_finite = math.isfinite(record.grad_norm)
        applied = self._precision.step(self._optimizer, grads_finite)
        if applied:
            if self._scheduler is not None:
                self._scheduler.step()
        else:
            record.skipped = "overflow" if self._precision.scaler is not None else "nonfinite"
            self._log_skip(record)
        return applied

    def _log_skip(self, record: StepRecord) -> None:
        # Every rank skips the same steps (their reduced gradients are identical): rank 0 says it.
        self._skips_logged += 1
        if self._skips_logged > _SKIPS_LOGGED or not self.is_main:
            return
        if record.skipped == "overflow":
            assert self._precision.scaler is not None
            why = (f"fp16 gradients overflowed; the loss scale is now {self._precision.scaler.get_scale():g} "
                   "(a few such steps at the start are normal while the scale calibrates)")
        else:
            why = f"the gradient norm is {record.grad_norm} (not finite)"
        more = " Further skips are only counted in the metrics." if self._skips_logged == _SKIPS_LOGGED else ""
        self._logger.warning(f"optimizer step {record.step} skipped: {why}.{more}")

    def _commit_finished(self) -> None:
        if self._finished is not None:
            record, self._finished = self._finished, None
            self._metrics.add(record)

    def _require_prepared(self, what: str) -> DistributedLoader:
        if self._loader is None:
            raise GradsyncError(f"call trainer.prepare(model, optimizer, dataset, ...) before trainer.{what}")
        return self._loader

    # -- values, agreement, evaluation -----------------------------------------------------

    def log(self, values: Mapping[str, Any] | None = None, /, **named: Any) -> None:
        """Attach scalar values to the current optimizer step.

        Values logged on several micro-steps of one window are averaged (weighted by their
        micro-batch sizes), then averaged across ranks. A key without "/" is written under
        train/ in TensorBoard; "eval/accuracy" keeps its own section.
        """
        record = self._record or self._finished
        if record is None:
            raise GradsyncError("trainer.log() attaches values to a training step; call it after trainer.step().")
        for key, value in {**(values or {}), **named}.items():
            if key in METRICS_KEYS:
                raise GradsyncError(f"trainer.log(): '{key}' is a metric gradsync writes itself; pick another name.")
            record.add_value(key, value, self._micro_samples)

    def agree_any(self, flag: bool | torch.Tensor) -> bool:
        """True on every rank if `flag` is true on any rank (one small all-reduce)."""
        return agree_any(flag)

    def agree_all(self, flag: bool | torch.Tensor) -> bool:
        """True on every rank if `flag` is true on every rank (one small all-reduce)."""
        return agree_all(flag)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside a DDP wrapper: evaluate with it, so no collective runs.

        Under FSDP and tensor parallelism the model is the user's module, sharded: its forward
        gathers parameters or exchanges activations, so every rank must run each evaluation
        batch (`eval_loader` gives every rank as many). Under a pipeline it is the pipelined
        model, called under torch.no_grad(): every rank of the pipeline gets the outputs.
        """
        return self._strategy.unwrap(model)

    def eval_loader(
        self, dataset: Any, *, batch_size: int, collate_fn: Callable[[list[Any]], Any] | None = None
    ) -> EvalLoader:
        """This rank's share of an evaluation set: every sample exactly once across data-parallel
        ranks (a tensor-parallel group shares its batches)."""
        placement = self._strategy.placement
        return EvalLoader(
            dataset, batch_size, rank=placement.data_rank, world_size=placement.data_world_size, device=self.device,
            collate_fn=collate_fn, equal_batches=self._strategy.lockstep_forward and self.world_size > 1,
        )

    def sum_over_ranks(self, *values: float | torch.Tensor) -> tuple[float, ...]:
        """Sum scalars (e.g. correct and total counts) over the data-parallel ranks, in one
        all-reduce (the ranks of a tensor-parallel group hold the same counts: counted once)."""
        placement = self._strategy.placement
        if not (self._dist.has_process_group and placement.data_world_size > 1):
            return tuple(float(v) for v in values)
        totals = torch.tensor([float(v) for v in values], dtype=torch.float64,
                              device=collective_device(placement.data_group))
        dist.all_reduce(totals, group=placement.data_group)
        return tuple(totals.tolist())

    # -- the end -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _failing_together(self) -> Iterator[None]:
        """Around checks every rank runs at the same point and that fail on every rank together:
        leave the process group cleanly (all ranks are here) before the error ends the process."""
        try:
            yield
        except GradsyncError:
            self._closed = True
            shutdown(self._dist, barrier=True)
            raise

    def _leave_at_exit(self) -> None:
        # A script that never called close() must still not abort in the group's destructor.
        if not self._closed:
            self._closed = True
            shutdown(self._dist, barrier=False)

    def _describe_run(self, ended: bool = False) -> None:
        """run.json, for the report's header: the configuration as it ran (auto's choices once
        made) and the wall time. A description is a convenience: a disk error only warns."""
        if not self.is_main:
            return
        summary = self.summary()
        description = {
            "world_size": self.world_size,
            "backend": self._dist.backend,
            "device": str(self.device),
            "parallel": self._config.parallel.strategy,
            "precision": self._config.precision,
            "compression": summary["compression"],
            "accumulation_steps": summary["accumulation_steps"],
            "started": self._started,
        }
        if ended:
            description["ended"] = time.time()
        path = rundir.RunDir(self._run_dir).description
        try:
            rundir.write_json(path, description)
        except OSError as error:
            self._logger.warning(f"could not write {path}: {error}")

    def summary(self) -> dict[str, Any]:
        """Totals over the run so far, identical on every rank: steps, skips, samples/s, comm
        share, and what the run chose: its compression (with auto's measurements), micro-batches
        per step and checkpoints written."""
        summary = self._metrics.summary()
        prepared = self._loader is not None
        summary["accumulation_steps"] = self.accumulation_steps if prepared else self._config.accumulation_steps
        summary["compression"] = self._config.ddp.compression.name
        tuner = self._strategy.compression
        if isinstance(tuner, AutoTuner):
            # What auto measured; "compression" is its choice once made ("none": plain DDP stays).
            summary["auto"] = tuner.describe()
            summary["compression"] = "auto" if tuner.deciding else summary["auto"]["compression"]
        summary["parallel"] = self._strategy.describe() if self._model is not None else {"strategy": self._strategy.name}
        saving = self._checkpointer
        summary["checkpoints_saved"] = saving.saves if saving is not None else 0
        summary["checkpoint_save_s"] = saving.save_seconds if saving is not None else 0.0  # the training thread's share
        return summary

    def close(self) -> None:
        """Write the last metrics and leave the process group. Collective: every rank calls it."""
        if self._closed:
            return
        self._closed = True
        if self._window is not None:
            self._logger.info("the last accumulation window was left unfinished; its gradients are dropped")
            self._window = self._record = None
            if self._optimizer is not None:
                self._optimizer.zero_grad(set_to_none=True)
        self._commit_finished()
        self._close_profile_window()
        self._save_if_due()
        self._metrics.flush()
        self._metrics.close()
        if self._checkpointer is not None:
            self._checkpointer.close()
        self._describe_run(ended=True)
        shutdown(self._dist)

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            # Peers may be stuck in a collective this rank will never join: any collective here
            # would hang. Keep what was written and leave the group without waiting for anyone.
            self._closed = True
            self._metrics.close()
            shutdown(self._dist, barrier=False)


class MicroStep:
    """One micro-batch: forward and backward run inside; on exit at a window's last micro-batch
    the gradients have been reduced and the optimizer steps.

    `stepped` tells, after exit, whether an optimizer update was applied.
    """

    def __init__(self, trainer: Trainer, samples: int, is_boundary: bool) -> None:
        self._trainer = trainer
        self.samples = samples
        self.is_boundary = is_boundary
        self.backward_done = False
        self.stepped = False
        self._stack = ExitStack()
        self._forward: Any = None

    def __enter__(self) -> "MicroStep":
        trainer = self._trainer
        self._stack.enter_context(trainer._strategy.micro_step(synced=self.is_boundary))
        self._stack.enter_context(trainer._precision.autocast())
        # Everything before step.backward() is the forward (model and loss), as the profile sees it.
        self._forward = phase("forward")
        self._forward.__enter__()
        return self

    def _end_forward(self) -> None:
        if self._forward is not None:
            self._forward.__exit__(None, None, None)
            self._forward = None

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate the micro-batch's mean loss, weighted by its share of the window."""
        if self.backward_done:
            raise GradsyncError("step.backward() was called twice in one micro-step; call it once per batch.")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise GradsyncError(
                "step.backward() takes the micro-batch's scalar loss (a mean over its samples); got "
                + (f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__)
                + "."
            )
        self._end_forward()
        self._trainer._backward(loss, self.samples, synced=self.is_boundary)
        self.backward_done = True

    def forward_backward(self, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
        """`loss_fn(model(inputs), targets)` and its backward, under any parallel strategy; the
        loss (detached), equal on every rank that computed the batch together.

        A pipeline ("pp") cannot be called like a module in training: its stages run the
        forward and backward of micro-batches interleaved, and only the last stage sees
        outputs. This one call works under every strategy, so one loop serves them all.
        """
        if self.backward_done:
            raise GradsyncError("step.forward_backward() runs the backward: call it once per micro-step, without step.backward().")
        trainer = self._trainer
        strategy = trainer._strategy
        if not hasattr(strategy, "forward_backward"):
            loss = loss_fn(trainer._wrapped(inputs), targets)
            self.backward(loss)
            return loss.detach()
        self._end_forward()
        loss = trainer._pipeline_backward(inputs, targets, loss_fn, self.samples)
        self.backward_done = True
        return loss

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._end_forward()
        self._stack.close()
        if exc is not None and (explained := self._trainer._strategy.explain(exc)):
            raise explained from exc
        if exc_type is None and self.is_boundary:
            self.stepped = self._trainer._close_window(reduced=self.backward_done)


def _is_sharded(model: nn.Module) -> bool:
    """Already under FSDP2 or tensor parallelism (a parameter is a DTensor)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _rebind_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str], now: dict[str, nn.Parameter]) -> None:
    """Point the optimizer at the model's parameters after wrapping, by name.

    FSDP2 and tensor parallelism replace each parameter with a sharded one, so an optimizer
    built from the plain model would step tensors nothing uses any more (torch's own recipe
    is to build it after sharding; prepare() takes it either way). DDP keeps the parameters.
    """
    for group in optimizer.param_groups:
        # A pipeline's rank holds some of the layers: the others' parameters leave its optimizer.
        group["params"] = [now[names[id(p)]] for p in group["params"] if names[id(p)] in now]


def _per_parameter(optimizer: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict (keyed by parameter name) as one entry per parameter: its state
    and its group's hyper-parameters. A pipeline's ranks hold different parameters, and the
    next run may split the model differently: entries keyed by name load wherever they land."""
    entries = {}
    for group in optimizer["param_groups"]:
        hyper = {k: v for k, v in group.items() if k != "params"}
        for name in group["params"]:
            entries[name] = {"state": optimizer["state"].get(name, {}), "group": hyper}
    return entries


def _from_per_parameter(entries: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """The optimizer state dict to load, from `_per_parameter` entries: this run's groups (the
    parameters it holds), each with the hyper-parameters saved with its first parameter."""
    groups = [{**entries[group["params"][0]]["group"], "params": list(group["params"])} if group["params"] else group
              for group in current["param_groups"]]
    state = {name: entries[name]["state"] for group in groups for name in group["params"] if entries[name]["state"]}
    return {"state": state, "param_groups": groups}


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index or 0) == (b.index or 0)


def setup(config: TrainerConfig | None = None, **options: Any) -> Trainer:
    """Join the process group (or run alone) and return a Trainer.

    Pass options as keywords (`setup(accumulation_steps=4, precision="bf16")`) or a whole
    `TrainerConfig`; see `TrainerConfig` for each option.
    """
    if config is not None and options:
        raise ConfigError("pass either a TrainerConfig or keyword options to setup(), not both.")
    return Trainer(config if config is not None else TrainerConfig.from_kwargs(**options))


def _gpu_uuid(device: torch.device) -> str | None:
    """The CUDA device's UUID, by which NVML finds it whatever CUDA_VISIBLE_DEVICES says; None on CPU."""
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)
