"""Saving and resuming a training run with torch.distributed.checkpoint, atomically and safely.

The trainer hands over what a run consists of (`RunState`); the checkpointer decides when to
save, writes it, commits it, and finds and checks the checkpoint to resume from:

- *when*: every N optimizer steps, every T minutes, on SIGTERM. Ranks see the clock and the
  signal at different moments, so each optimizer step ends with one tiny all-reduce of those
  flags, and every rank saves at the same step or none does.
- *write*: DCP (`torch.distributed.checkpoint`), the model under its parameter names so a
  replicated tensor is written once, everything else as tensors plus a JSON skeleton
  (`gradsync.checkpoint.safe`). Each rank's own state (random generators, compression
  residuals) goes under `rank{r}/`, shared state once.
- *commit*: each rank hashes what it wrote, then rank 0 writes the manifest; before that, the
  folder is an unfinished save that resuming ignores (`gradsync.checkpoint.store`).
- *async*: DCP stages the state in memory and writes from a thread on a group of its own (two
  threads issuing collectives on one group would interleave); the commit happens at the first
  step after every rank reported its part written.
- *resume*: the newest committed checkpoint whose files all match their checksums, checked by
  the ranks in parallel; a broken one is skipped with a warning, a checkpoint of another model
  or of a newer format is an error that names what differs.
"""

from __future__ import annotations

import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from gradsync import events
from gradsync.agreement import raise_if_any_rank_failed
from gradsync.checkpoint import safe, store
from gradsync.checkpoint.config import CheckpointConfig
from gradsync.checkpoint.store import CheckpointError
from gradsync.distributed import collective_device
from gradsync.errors import GradsyncError

EXIT_ON_SIGTERM = 128 + signal.SIGTERM


@dataclass
class RunState:
    """One checkpoint's contents: the model's parameters and buffers, state shared by every
    rank, this rank's own, and state sharded over the ranks (DTensors: FSDP's and tensor
    parallelism's optimizer state), which each rank writes its part of and loads resharded.

    A model spread over the ranks by layers (a pipeline's stages) has `staged` state: plain
    state per parameter, keyed by the parameter's name, written by the ranks that hold it and
    loaded by whichever ranks hold it next (so another split loads it too). Its ranks each
    hold different parameters and buffers: the manifest lists them all, and `writes_buffers`
    marks the ranks that write theirs (None: rank 0, whose buffers every rank uses).
    """

    parameters: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    shared: dict[str, Any]
    own: dict[str, Any]
    sharded: dict[str, Any] = field(default_factory=dict)
    staged: dict[str, Any] = field(default_factory=dict)
    writes_buffers: bool | None = None

    @property
    def model(self) -> dict[str, torch.Tensor]:
        return {**self.parameters, **self.buffers}


@dataclass
class Loaded:
    """What a resume read: the checkpoint's folder, manifest, shared state, this rank's (None
    when the checkpoint was written by a different world size) and the sharded state."""

    path: Path
    manifest: dict[str, Any]
    shared: dict[str, Any]
    own: dict[str, Any] | None
    sharded: dict[str, Any] = field(default_factory=dict)
    staged: dict[str, Any] = field(default_factory=dict)


@dataclass
class _PendingSave:
    step: int
    path: Path
    manifest: dict[str, Any]
    future: Any
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class StoppedBySignal(SystemExit):
    """Raised on every rank after the final checkpoint that SIGTERM asked for."""


class Checkpointer:
    """Decides when to save, saves, commits, and finds the checkpoint to resume from."""

    def __init__(
        self,
        config: CheckpointConfig,
        *,
        rank: int,
        world_size: int,
        group: Any,
        distributed: bool,
        log: Callable[[str], None],
        warn: Callable[[str], None],
        description: dict[str, Any] | None = None,
    ) -> None:
        assert config.dir is not None
        self.config = config
        self.root = Path(config.dir)
        self.rank = rank
        self.world_size = world_size
        self.group = group  # the group DCP's synchronous collectives and the agreement run on
        self.distributed = distributed and world_size > 1
        self.log = log
        self.warn = warn
        self.description = description or {}  # the run's configuration, written into each manifest
        # Built by every rank at the same point (here), as new_group requires.
        self.async_group = dist.new_group(backend="gloo") if config.async_save and self.distributed else group
        self.saves = 0
        self.save_seconds = 0.0  # time the training thread spent in saves (staging, for async)
        self.last_saved_step: int | None = None
        self._last_save_time = time.monotonic()
        self._pending: _PendingSave | None = None
        self.due_step: int | None = None  # a save agreed at this step, made before the next batch
        self._stop = False
        self._sigterm = False
        self._previous_handler: Any = None
        # Without a signal, a clock or a background save to agree on, every rank already knows
        # when to save (every N steps) and the per-step all-reduce is skipped.
        self._must_agree = self.distributed and (config.on_sigterm or config.every_minutes is not None or config.async_save)
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
        if config.on_sigterm and threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)

    # -- when ------------------------------------------------------------------------------

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if not self._sigterm:
            self._sigterm = True
            self.warn("SIGTERM received: saving a checkpoint after this optimizer step, then exiting")

    def after_step(self, step: int) -> None:
        """Called by every rank at the end of each optimizer step: commit a finished background
        save, and agree whether to save (and stop) before the next batch."""
        stop, time_due, pending_done, pending_failed = self._agree(
            self._sigterm,
            self.rank == 0
            and self.config.every_minutes is not None
            and time.monotonic() - self._last_save_time >= 60 * self.config.every_minutes,
            self._pending is not None and self._pending.done.is_set() and self._pending.error is None,
            self._pending is not None and self._pending.error is not None,
        )
        if self._pending is not None and pending_failed:
            self._abandon_pending()
        elif self._pending is not None and pending_done == self.world_size:
            self._commit_pending()
        every = self.config.every_steps
        if stop or time_due or (every is not None and step % every == 0):
            self.due_step = step
        self._stop = bool(stop)

    def save_if_due(self, capture: Callable[[], RunState]) -> None:
        """Between two batches: save if the last optimizer step made a save due, and stop if
        SIGTERM asked for it.

        Not at the optimizer step itself: the user's code after it (logging, an EMA update, a
        counter) belongs to that step, and the next batch must not be fetched yet (fetching can
        draw random numbers), so a resumed run starts exactly where the saved one left off.
        """
        if self.due_step is None:
            return
        step, self.due_step = self.due_step, None
        self.save(step, capture(), wait=self._stop)
        if self._stop:
            self.close()
            self.log(f"stopped by SIGTERM after saving step {step}; resume with checkpoint.resume='auto'")
            raise StoppedBySignal(EXIT_ON_SIGTERM)

    def _agree(self, *flags: bool) -> list[int]:
        if not self._must_agree:
            return [int(f) for f in flags]
        values = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=collective_device(self.group))
        dist.all_reduce(values, group=self.group)
        return values.tolist()

    # -- saving ----------------------------------------------------------------------------

    def save(self, step: int, state: RunState, *, wait: bool = False) -> None:
        """Write the checkpoint of `step` (collective: every rank calls it at the same step)."""
        started = time.perf_counter()
        self._finish_pending()
        path = store.step_dir(self.root, step)
        # DCP's writers look into the folder before its first collective: none may see the old
        # one, so this is agreed before anyone writes.
        self._on_every_rank(step, path, lambda: self._fresh_folder(path))
        manifest = {
            "gradsync_version": store.gradsync_version(),
            "step": step,
            "world_size": self.world_size,
            "time": time.time(),
            "model": self._whole_model(_entries(state.model), spread=bool(state.staged)),
            "config": self.description,
            "data": {k: state.shared["loader"][k] for k in ("epoch", "position", "samples_consumed")} if "loader" in state.shared else {},
        }
        contents = {
            "model": state.parameters,
            "shared": safe.encode(state.shared),
            f"rank{self.rank}": safe.encode(state.own),
        }
        if state.sharded:
            contents["sharded"] = safe.encode(state.sharded)
        if state.staged:
            contents["staged"] = {name: safe.encode(entry) for name, entry in state.staged.items()}
        writes_buffers = self.rank == 0 if state.writes_buffers is None else state.writes_buffers
        if writes_buffers and state.buffers:
            # Buffers (BatchNorm statistics) may differ across ranks between DDP's broadcasts
            # from rank 0; rank 0's are the ones every rank uses next, so only rank 0 saves them.
            contents["buffers"] = state.buffers
        if self.config.async_save and not wait:
            self._save_async(step, path, manifest, contents)
        else:
            # DCP fails on every rank when one rank's write fails; the steps after it are each
            # rank's own, so their failures are shared before anyone goes on (and that
            # agreement is the barrier between writing and committing).
            self._on_every_rank(step, path, lambda: self._write(contents, path))
            events.checkpoint_written(step)
            self._on_every_rank(step, path, lambda: store.write_rank_checksums(path, self.rank))
            self._on_every_rank(step, path, lambda: self._commit(path, manifest))
        self.save_seconds += time.perf_counter() - started
        self._last_save_time = time.monotonic()

    def _whole_model(self, mine: dict[str, Any], spread: bool) -> dict[str, Any]:
        """The model's entries for the manifest: this rank's, or every rank's together when the
        model is spread over them by layers."""
        if not (spread and self.distributed):
            return mine
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.group)
        return {name: entry for part in everyone for name, entry in part.items()}

    def _fresh_folder(self, path: Path) -> None:
        if self.rank == 0:
            # A folder of the same step (a save that never committed, a step saved again) is
            # replaced, never mixed with this one.
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True, exist_ok=True)

    def _write(self, contents: dict[str, Any], path: Path) -> None:
        with safe.coordination(self.group) as participants:
            dcp.save(contents, storage_writer=dcp.FileSystemWriter(path), **participants)

    def _on_every_rank(self, step: int, path: Path, part: Callable[[], None]) -> None:
        """Run this rank's part of a save; if it failed on any rank, remove the
        unfinished folder and raise on every rank, so none waits for the others in a collective."""
        error: CheckpointError | None = None
        try:
            part()
        except (OSError, CheckpointException) as failure:
            if self.rank == 0:
                store.remove_unfinished(path)  # first, so the free space reported is what is left
            error = self._write_error(step, path, failure)
        try:
            if self.distributed:
                raise_if_any_rank_failed(error, self.group)
            elif error is not None:
                raise error
        except GradsyncError:
            if self.rank == 0 and error is None:  # another rank's part failed
                store.remove_unfinished(path)
            raise

    def _write_error(self, step: int, path: Path, failure: BaseException, *, going_on: bool = False) -> CheckpointError:
        """What a user needs when a save cannot be written: the folder, why, the free space.
        `going_on`: the save was a background one, and training continues without it."""
        cause = _first_failure(failure)
        reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else f"{type(cause).__name__}: {cause}"
        return CheckpointError(
            f"the checkpoint of step {step} could not be written to {path}: {reason} ({store.space_report(self.root)}). "
            "The unfinished folder is removed."
            + (" Training goes on and the next save is made as planned." if going_on else "")
            + " Free space in checkpoint.dir, lower checkpoint.keep, or point checkpoint.dir at a larger filesystem, "
            "then resume with checkpoint.resume='auto'."
        )

    def _save_async(self, step: int, path: Path, manifest: dict[str, Any], contents: dict[str, Any]) -> None:
        with safe.coordination(self.async_group) as participants:
            future = dcp.async_save(contents, storage_writer=dcp.FileSystemWriter(path), **participants)
        pending = _PendingSave(step, path, manifest, future)

        def written(finished: Any) -> None:
            try:
                finished.result()
                events.checkpoint_written(step)
                store.write_rank_checksums(path, self.rank)
            except BaseException as error:  # reported at the next step, on every rank
                pending.error = error
            pending.done.set()

        future.add_done_callback(written)
        self._pending = pending

    def _finish_pending(self) -> None:
        """Wait for the background save still running (collective), and commit it."""
        if self._pending is None:
            return
        self._pending.done.wait()
        failed = self._agree(self._pending.error is not None)[0]
        if failed:
            self._abandon_pending()
        else:
            self._commit_pending()

    def _abandon_pending(self) -> None:
        """A background save failed on some rank: say why and where, drop it, and go on (the
        next due save is made as usual)."""
        assert self._pending is not None
        pending, self._pending = self._pending, None
        if self.rank == 0:
            store.remove_unfinished(pending.path)
        if pending.error is not None:
            self.warn(str(self._write_error(pending.step, pending.path, pending.error, going_on=True)))
        elif self.rank == 0:
            self.warn(f"the background save of step {pending.step} to {pending.path} failed on another rank "
                      f"(its log says why); the previous checkpoint stays the newest and training goes on.")

    def _commit_pending(self) -> None:
        """Commit the background save every rank reported written. The manifest is rank 0's to
        write; if that fails the save stays unfinished, and rank 0 says so."""
        assert self._pending is not None
        pending, self._pending = self._pending, None
        try:
            self._commit(pending.path, pending.manifest)
        except OSError as failure:
            store.remove_unfinished(pending.path)
            self.warn(str(self._write_error(pending.step, pending.path, failure, going_on=True)))

    def _commit(self, path: Path, manifest: dict[str, Any]) -> None:
        if self.rank == 0:
            store.commit(path, manifest, self.world_size)
            pruned = store.prune(self.root, self.config.keep, manifest["step"])
            older = f" (deleted the older {', '.join(p.name for p in pruned)}: keep={self.config.keep})" if pruned else ""
            self.log(f"checkpoint of step {manifest['step']} committed: {path}{older}")
        self.last_saved_step = manifest["step"]
        self.saves += 1

    def close(self) -> None:
        """Finish a background save and give SIGTERM back to its previous handler (collective)."""
        self._finish_pending()
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None

    # -- the folder --------------------------------------------------------------------------

    def foreign_checkpoints(self) -> tuple[list[Path], CheckpointError | None]:
        """The step folders in `dir` this run does not continue from, and the error that refuses
        them when the user did not ask to overwrite.

        A run owns the checkpoints it resumes from and those before them. Any other folder
        belongs to another run (or to the future of a run resumed from an older step): mixed
        with this run's saves, keep-newest would count them and delete this run's own, and a
        later resume="auto" would continue the other run. `resume="auto"` continues from the
        newest, so it leaves nothing foreign.
        """
        resume = self.config.resume
        if resume == "auto":
            return [], None
        folders = store.checkpoint_dirs(self.root)
        resumed_step = None
        if resume is not None and Path(resume).resolve().parent == self.root.resolve():
            resumed_step = store.step_of(Path(resume))
        if resumed_step is not None:
            foreign = [path for step, path in folders if step > resumed_step]
        else:
            foreign = [path for _, path in folders]
        committed = [store.step_of(path) for path in foreign if (path / store.MANIFEST).exists()]
        if not committed or self.config.overwrite:
            return foreign, None
        steps = ", ".join(str(step) for step in sorted(committed))
        if resumed_step is not None:
            situation = (
                f"holds checkpoints newer than step {resumed_step}, the one this run resumes from (steps {steps}): "
                "this run's saves would mix with them and a later resume='auto' would continue them instead"
            )
            ways_out = "move them away, resume into another checkpoint.dir"
        else:
            start = "starts fresh (resume=None)" if resume is None else f"resumes from {resume}"
            situation = (
                f"already holds checkpoints of another run (steps {steps}) and this run {start}: the two runs' "
                "checkpoints would mix, keep-newest would delete this run's saves, and a later resume='auto' "
                "would continue the other run"
            )
            ways_out = "continue that run with checkpoint.resume='auto', give this run another checkpoint.dir"
        return foreign, CheckpointError(
            f"checkpoint.dir {self.root} {situation}. To go on: {ways_out}, or pass checkpoint.overwrite=True "
            "to delete them before training starts."
        )

    def remove(self, foreign: list[Path]) -> None:
        """Delete the step folders `foreign_checkpoints` found (rank 0, with overwrite=True)."""
        if self.rank != 0 or not foreign:
            return
        for path in foreign:
            (path / store.MANIFEST).unlink(missing_ok=True)  # first: a half-deleted folder is never loadable
            shutil.rmtree(path, ignore_errors=True)
        steps = ", ".join(str(store.step_of(path)) for path in reversed(foreign))
        self.warn(f"checkpoint.overwrite=True: deleted {len(foreign)} checkpoint folder(s) of another run in {self.root} (steps {steps})")

    # -- resuming --------------------------------------------------------------------------

    def find_and_load(self, model: RunState, sharded: Callable[[], dict[str, Any]] | None = None,
                      staged: list[str] | None = None) -> Loaded | None:
        """Load the checkpoint `resume` names into the parameters and buffers of `model` (in
        place) and return the rest.

        `sharded` builds the sharded state to load into (called only when there is a checkpoint:
        building an optimizer's state dict initialises its state). `staged`: the names of the
        parameters whose staged state this rank loads (a pipeline's stages).

        None when `resume="auto"` finds no checkpoint at all: the run starts fresh.
        """
        resume = self.config.resume
        if resume is None:
            return None
        if resume == "auto":
            candidates = []
            for _, path in store.checkpoint_dirs(self.root):
                if (path / store.MANIFEST).exists():
                    candidates.append(path)
                else:
                    self.log(f"ignoring {path}: a save that never finished")
            if not candidates:
                self.log(f"no committed checkpoint in {self.root}: starting from scratch")
                return None
        else:
            candidates = [Path(resume)]
            if not candidates[0].is_dir():
                raise CheckpointError(f"checkpoint.resume={resume!r}: no such checkpoint folder.")
        problems: list[str] = []
        for path in candidates:
            manifest, trouble = self._check(path, self._whole_model(_entries(model.model), spread=staged is not None))
            if trouble:
                problems.append(f"{path.name}: " + "; ".join(trouble))
                if resume == "auto":
                    self.warn(f"skipping checkpoint {path}: " + "; ".join(trouble))
                continue
            assert manifest is not None
            return self._load(path, manifest, model, sharded, staged)
        raise CheckpointError(
            "no valid checkpoint to resume from: " + " | ".join(problems)
            + ". Delete the broken folders, point checkpoint.resume at a good one, or set it to None to start fresh."
        )

    def _check(self, path: Path, model: dict[str, Any]) -> tuple[dict[str, Any] | None, list[str]]:
        """The manifest and the problems every rank agrees on (each rank hashes its share of the files)."""
        try:
            manifest = store.read_manifest(path)
        except store.NewerFormatError:
            raise
        except CheckpointError as error:
            return None, [str(error)]
        _check_same_model(path, manifest, model)
        names = sorted(manifest["files"])
        mine = store.verify_files(path, manifest, names[self.rank :: self.world_size])
        if self.distributed:
            everyone: list[Any] = [None] * self.world_size
            dist.all_gather_object(everyone, mine, group=self.group)
            mine = [problem for part in everyone for problem in part]
        return manifest, mine

    def _load(self, path: Path, manifest: dict[str, Any], model: RunState, sharded: Callable[[], dict[str, Any]] | None,
              staged: list[str] | None) -> Loaded:
        metadata = safe.read_metadata(path / ".metadata")
        # Each rank's own state (random streams, residuals) belongs to its place in the job: it is
        # taken back only by the same world size spread the same way (a strategy change moves
        # the data-parallel ranks: two ranks of a tensor-parallel group must draw alike).
        written_parallel = manifest.get("config", {}).get("parallel")
        same_world = manifest["world_size"] == self.world_size and (
            written_parallel is None or written_parallel == self.description.get("parallel", written_parallel)
        )
        own_prefix = f"rank{self.rank}."
        contents: dict[str, Any] = {"model": model.parameters, "shared": _skeleton(metadata, "shared.")}
        if model.buffers:
            contents["buffers"] = model.buffers
        if same_world:
            contents[f"rank{self.rank}"] = _skeleton(metadata, own_prefix)
        # How the optimizer state is kept must match: one copy, sharded DTensors, or per parameter.
        saved_layout = next((layout for prefix, layout in _OPTIMIZER_LAYOUTS.items()
                             if any(key.startswith(prefix) for key in metadata.state_dict_metadata)), "one copy")
        this_layout = _OPTIMIZER_LAYOUTS["sharded."] if sharded is not None else (
            _OPTIMIZER_LAYOUTS["staged."] if staged is not None else "one copy")
        if saved_layout != this_layout:
            written = manifest.get("config", {}).get("parallel", {}).get("strategy", "ddp")
            raise CheckpointError(
                f"{path} was written with parallel={written!r}, whose optimizer state is kept as {saved_layout}; "
                f"this run keeps it as {this_layout}. Resume with parallel={written!r}."
            )
        if staged is not None:
            contents["staged"] = {name: _skeleton(metadata, f"staged.{name}.") for name in staged}
        if sharded is not None:
            # Tensors load into this run's own layout (DCP reshards DTensors); the skeleton of
            # plain values is the checkpoint's.
            live = safe.encode(sharded())
            live[safe.JSON_KEY] = _skeleton(metadata, "sharded.")[safe.JSON_KEY]
            contents["sharded"] = live
        safe.load(contents, path, self.group)
        self.last_saved_step = manifest["step"]
        self.log(f"resuming from {path} (step {manifest['step']})")
        return Loaded(
            path=path,
            manifest=manifest,
            shared=safe.decode(contents["shared"]),
            own=safe.decode(contents[f"rank{self.rank}"]) if same_world else None,
            sharded=safe.decode(contents["sharded"]) if sharded is not None else {},
            staged={name: safe.decode(entry) for name, entry in contents.get("staged", {}).items()},
        )


# The optimizer state's layouts, by the key prefix a checkpoint holds them under.
_OPTIMIZER_LAYOUTS = {"sharded.": "shards over the ranks", "staged.": "one entry per parameter (a pipeline's stages)"}


def _first_failure(failure: BaseException) -> BaseException:
    """The error inside DCP's CheckpointException (it wraps each failing rank's, with frames)."""
    if isinstance(failure, CheckpointException) and failure.failures:
        first = next(iter(failure.failures.values()))
        return first[0] if isinstance(first, tuple) else first
    return failure


def _skeleton(metadata: Any, prefix: str) -> dict[str, torch.Tensor]:
    """Empty tensors shaped like the checkpoint's entries under `prefix`, for DCP to load into."""
    entries = {}
    for key, item in metadata.state_dict_metadata.items():
        if key.startswith(prefix):
            if not hasattr(item, "size"):
                raise safe.UnsafeCheckpointError(f"the checkpoint stores '{key}' as a pickled object; gradsync refuses to unpickle it.")
            entries[key[len(prefix) :]] = torch.empty(item.size, dtype=item.properties.dtype)
    if safe.JSON_KEY not in entries:
        raise CheckpointError(f"the checkpoint has no '{prefix}{safe.JSON_KEY}' entry: it was not written by gradsync.")
    return entries


def _entries(model: dict[str, torch.Tensor]) -> dict[str, list[Any]]:
    """The manifest's description of model tensors: name -> [shape, dtype]."""
    return {name: [list(t.shape), str(t.dtype).removeprefix("torch.")] for name, t in model.items()}


def _check_same_model(path: Path, manifest: dict[str, Any], model: dict[str, list[Any]]) -> None:
    saved = {name: tuple(shape) for name, (shape, _) in manifest["model"].items()}
    current = {name: tuple(shape) for name, (shape, _) in model.items()}
    missing = sorted(set(current) - set(saved))
    unexpected = sorted(set(saved) - set(current))
    misshaped = sorted(name for name in set(saved) & set(current) if saved[name] != current[name])
    if missing or unexpected or misshaped:
        parts = []
        if missing:
            parts.append("missing from the checkpoint: " + ", ".join(missing))
        if unexpected:
            parts.append("in the checkpoint but not in the model: " + ", ".join(unexpected))
        if misshaped:
            parts.append("different shapes: " + ", ".join(f"{n} {list(saved[n])} saved vs {list(current[n])} now" for n in misshaped))
        raise CheckpointError(
            f"{path} was saved from a different model ({'; '.join(parts)}). Resume with the model "
            "that wrote it, or start fresh in another checkpoint folder."
        )


def model_state(
    model: nn.Module,
    shared: dict[str, Any] | None = None,
    own: dict[str, Any] | None = None,
    sharded: dict[str, Any] | None = None,
    staged: dict[str, Any] | None = None,
    writes_buffers: bool | None = None,
) -> RunState:
    """The module's parameters and buffers by name, sharing their storage (DCP loads in place;
    under FSDP and tensor parallelism they are DTensors, each rank's shard)."""
    names = {name for name, _ in model.named_parameters()}
    tensors = {name: tensor.detach() for name, tensor in model.state_dict(keep_vars=True).items()}
    return RunState(
        parameters={n: t for n, t in tensors.items() if n in names},
        buffers={n: t for n, t in tensors.items() if n not in names},
        shared=shared or {},
        own=own or {},
        sharded=sharded or {},
        staged=staged or {},
        writes_buffers=writes_buffers,
    )
