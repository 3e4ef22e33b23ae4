"""The options of `gradsync.setup(parallel=...)`: which strategy spreads the model over the ranks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from gradsync.errors import ConfigError

STRATEGIES = ("ddp", "fsdp", "hsdp", "tp", "fsdp+tp")
TP_STYLES = ("colwise", "rowwise")


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
    """

    strategy: str = "ddp"
    blocks: tuple[Any, ...] | None = None
    shard_size: int | None = None
    tp_size: int | None = None
    tp_plan: Mapping[str, Any] | None = None
    reshard_after_forward: bool = True

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

    @property
    def sharded(self) -> bool:
        """True when parameters and optimizer state live as DTensors (every strategy but DDP)."""
        return self.strategy != "ddp"

    @classmethod
    def of(cls, value: Any) -> "ParallelConfig":
        """A strategy name, a dict of fields or a ParallelConfig."""
        from gradsync.sections import section

        if isinstance(value, str):
            return cls(strategy=value)
        return section(cls, value, "parallel")
