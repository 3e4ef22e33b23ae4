"""The options of `gradsync.setup(parallel=...)`: which strategy spreads the model over the ranks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from gradsync.errors import ConfigError

STRATEGIES = ("ddp", "fsdp", "hsdp", "tp", "fsdp+tp", "pp", "pp+ddp")
TP_STYLES = ("colwise", "rowwise")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
_PIPELINES = ("pp", "pp+ddp")


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is spread over the ranks.

    strategy:
        "ddp" (default): every rank holds the whole model; gradients are all-reduced (the `ddp`
        options apply). "fsdp": FSDP2 `fully_shard`, parameters, gradients and optimizer state
        sharded over every rank. "hsdp": sharded within groups of `shard_size` ranks (a node by
        default), replicated across them. "tp": tensor parallelism over `tp_size` ranks (all
        of them by default), every rank of a tensor-parallel group sees the same batches.
        "fsdp+tp": a 2-D mesh, tensor parallel within groups of `tp_size`, FSDP across them.
        "pp": pipeline parallelism, the model split by layers into stages, one stage per rank
        (`stages_per_rank` for interleaved schedules). "pp+ddp": pipelines of `pp_size` ranks,
        each stage replicated across pipelines and its gradients all-reduced by DDP.
    blocks: the FSDP units, as module class names or classes (e.g. ("TransformerBlock",));
        None shards each submodule class that repeats (a transformer's blocks), then the root.
    shard_size: "hsdp" only: ranks one copy of the model is sharded over.
    tp_size: ranks one tensor-parallel group spans ("fsdp+tp" needs it).
    tp_plan: module path -> "colwise", "rowwise" or a `ParallelStyle`; paths may use "*" for
        one name (e.g. {"blocks.*.attn.q": "colwise"}). None applies the standard plan to the
        blocks it recognises (q/k/v and MLP up column-wise, attention output and MLP down
        row-wise).
    reshard_after_forward: FSDP frees gathered parameters after forward (less memory) and
        gathers them again for backward (more traffic); False keeps them to the backward.
    split_points: "pp" only: the module paths where each stage after the first begins, in
        forward order (e.g. ("blocks.4", "blocks.8") makes three stages; () one). None: each of
        the model's top-level children is one stage. The model's forward must be its children
        applied in order (an nn.Sequential is); a child named in a path must be an
        nn.Sequential itself. See gradsync.parallel.pp.
    schedule: "pp" only: "gpipe" (every forward, then every backward), "1f1b" (one forward,
        one backward: fewer activations held) or "interleaved-1f1b" (several stages per rank,
        a smaller bubble; needs stages_per_rank >= 2).
    microbatches: "pp" only: micro-batches each loader batch is split into for the schedule
        (default: twice the pipeline's ranks). More shrink the bubble, (p-1)/(m+p-1) of a step.
    pp_size: "pp+ddp" only: ranks one pipeline spans ("pp" spans all of them).
    stages_per_rank: "pp" only: stages each rank holds (interleaved schedules).
    """

    strategy: str = "ddp"
    blocks: tuple[Any, ...] | None = None
    shard_size: int | None = None
    tp_size: int | None = None
    tp_plan: Mapping[str, Any] | None = None
    reshard_after_forward: bool = True
    split_points: tuple[str, ...] | None = None
    schedule: str = "1f1b"
    microbatches: int | None = None
    pp_size: int | None = None
    stages_per_rank: int = 1

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"parallel={self.strategy!r} is unknown; use one of {', '.join(STRATEGIES)}.")
        if self.blocks is not None:
            blocks = (self.blocks,) if isinstance(self.blocks, (str, type)) else tuple(self.blocks)
            if not blocks or not all(isinstance(b, (str, type)) for b in blocks):
                raise ConfigError(
                    f"parallel.blocks={self.blocks!r}: name the module classes to shard, as class names or classes."
                )
            object.__setattr__(self, "blocks", blocks)
        if self.shard_size is not None and self.strategy != "hsdp":
            raise ConfigError("parallel.shard_size applies to strategy 'hsdp' only.")
        if self.tp_size is not None and self.strategy not in ("tp", "fsdp+tp"):
            raise ConfigError("parallel.tp_size applies to strategies 'tp' and 'fsdp+tp' only.")
        if self.tp_plan is not None and self.strategy not in ("tp", "fsdp+tp"):
            raise ConfigError("parallel.tp_plan applies to strategies 'tp' and 'fsdp+tp' only.")
        if self.blocks is not None and self.strategy not in ("fsdp", "hsdp", "fsdp+tp"):
            raise ConfigError("parallel.blocks names FSDP's units; it applies to 'fsdp', 'hsdp' and 'fsdp+tp'.")
        self._check_pipeline()
        for name in ("shard_size", "tp_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"parallel.{name}={value!r}: use a positive integer.")
        if self.strategy == "fsdp+tp" and self.tp_size is None:
            raise ConfigError(
                "parallel='fsdp+tp' needs parallel.tp_size, the ranks one tensor-parallel group spans "
                "(usually the GPUs of one node, whose links are fastest), e.g. {'strategy': 'fsdp+tp', 'tp_size': 2}."
            )
        if self.tp_plan is not None:
            if not isinstance(self.tp_plan, Mapping) or not self.tp_plan:
                raise ConfigError("parallel.tp_plan: give a dict of module path -> 'colwise', 'rowwise' or a ParallelStyle.")
            for path, style in self.tp_plan.items():
                if isinstance(style, str) and style not in TP_STYLES:
                    raise ConfigError(
                        f"parallel.tp_plan[{path!r}]={style!r}: use 'colwise', 'rowwise' or a "
                        "torch.distributed.tensor.parallel ParallelStyle."
                    )

    def _check_pipeline(self) -> None:
        pipeline = self.strategy in _PIPELINES
        if not pipeline:
            given = [name for name, default in (("split_points", None), ("schedule", "1f1b"), ("microbatches", None),
                                                ("pp_size", None), ("stages_per_rank", 1))
                     if getattr(self, name) != default]
            if given:
                raise ConfigError(f"parallel.{given[0]} applies to strategies 'pp' and 'pp+ddp' only.")
            return
        if self.split_points is not None:
            points = (self.split_points,) if isinstance(self.split_points, str) else tuple(self.split_points)
            if not all(isinstance(p, str) and p for p in points):
                raise ConfigError(
                    f"parallel.split_points={self.split_points!r}: give the module paths where stages begin, "
                    "e.g. ('blocks.4',)."
                )
            object.__setattr__(self, "split_points", points)
        if self.schedule not in PP_SCHEDULES:
            raise ConfigError(f"parallel.schedule={self.schedule!r} is unknown; use one of {', '.join(PP_SCHEDULES)}.")
        for name in ("microbatches", "pp_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"parallel.{name}={value!r}: use a positive integer.")
        if not isinstance(self.stages_per_rank, int) or isinstance(self.stages_per_rank, bool) or self.stages_per_rank < 1:
            raise ConfigError(f"parallel.stages_per_rank={self.stages_per_rank!r}: use a positive integer.")
        interleaved = self.schedule == "interleaved-1f1b"
        if interleaved != (self.stages_per_rank > 1):
            raise ConfigError(
                "parallel.schedule='interleaved-1f1b' runs several stages per rank: set stages_per_rank >= 2 with it "
                "(and only with it)." if interleaved else
                f"parallel.stages_per_rank={self.stages_per_rank} needs schedule='interleaved-1f1b'; 'gpipe' and "
                "'1f1b' run one stage per rank."
            )
        if self.strategy == "pp" and self.pp_size is not None:
            raise ConfigError("parallel.pp_size applies to 'pp+ddp'; 'pp' spans every rank.")
        if self.strategy == "pp+ddp" and self.pp_size is None:
            raise ConfigError(
                "parallel='pp+ddp' needs parallel.pp_size, the ranks one pipeline spans, e.g. "
                "{'strategy': 'pp+ddp', 'pp_size': 2}: stages then sit on consecutive groups of ranks "
                "and the pipelines' copies of each stage all-reduce their gradients."
            )

    @property
    def pipeline(self) -> bool:
        """True for the pipeline strategies ("pp", "pp+ddp")."""
        return self.strategy in _PIPELINES

    @property
    def sharded(self) -> bool:
        """True when the model is spread over the ranks, so each needs a process group even alone
        and an optimizer built before prepare() must not have stepped (every strategy but DDP)."""
        return self.strategy != "ddp"

    @classmethod
    def of(cls, value: Any) -> "ParallelConfig":
        """A strategy name, a dict of fields or a ParallelConfig."""
        from gradsync.sections import section

        if isinstance(value, str):
            return cls(strategy=value)
        return section(cls, value, "parallel")
