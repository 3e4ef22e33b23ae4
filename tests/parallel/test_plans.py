"""What gradsync shards and splits when the user names nothing: FSDP's units and tensor
parallelism's standard plan, read off real models (no process group needed)."""

from __future__ import annotations

import pytest
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from gradsync.bench.workloads import ResNet18, TinyGPT, lora_gpt
from gradsync.errors import ConfigError
from gradsync.parallel.fsdp import block_sized_leftovers, named_blocks, repeated_blocks
from gradsync.parallel.tp import resolve_plan, standard_plan


def _units(model):
    blocks = repeated_blocks(model)
    return [name for name, _ in blocks + block_sized_leftovers(model, blocks)]


def test_fsdp_units_are_the_repeated_blocks_and_the_block_sized_rest():
    # A transformer: its blocks, and the embedding and output head (each larger than a block),
    # which left in the root would stay gathered through forward and backward.
    assert _units(TinyGPT()) == ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "embed", "head"]
    # A ResNet: its residual blocks (the stem and the head are smaller than one).
    assert _units(ResNet18()) == [f"layers.{i}" for i in range(8)]
    # An MLP's Linear layers repeat: each is a unit; nothing repeats in a lone Linear.
    assert _units(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))) == ["0", "2"]
    assert _units(nn.Linear(4, 4)) == []


def test_named_blocks_take_the_outermost_and_name_what_the_model_has():
    assert [n for n, _ in named_blocks(TinyGPT(), ("Block",))] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    with pytest.raises(ConfigError, match="TransformerBlock, which the model does not contain.*Attention, Block"):
        named_blocks(TinyGPT(), ("TransformerBlock",))


def test_the_standard_plan_splits_attention_and_mlp_of_every_block():
    plan = standard_plan(TinyGPT())
    for i in range(4):
        for name in ("attn.q", "attn.k", "attn.v", "mlp.up"):
            assert isinstance(plan.pop(f"blocks.{i}.{name}"), ColwiseParallel)
        for name in ("attn.o", "mlp.down"):
            assert isinstance(plan.pop(f"blocks.{i}.{name}"), RowwiseParallel)
    assert plan == {}, "the embedding and output head stay replicated"


def test_a_model_without_recognised_blocks_needs_a_plan_and_a_pattern_must_match():
    with pytest.raises(ConfigError, match="no attention or MLP was recognised"):
        resolve_plan(ResNet18(), None)
    # LoRA wraps each projection: its Linear children are base/lora_a/lora_b, not q/k/v.
    with pytest.raises(ConfigError, match="Give parallel.tp_plan"):
        resolve_plan(lora_gpt(), None)
    plan = resolve_plan(TinyGPT(), {"blocks.*.mlp.up": "colwise", "blocks.*.mlp.down": "rowwise"})
    assert sorted(plan) == sorted([f"blocks.{i}.mlp.{n}" for i in range(4) for n in ("up", "down")])
    with pytest.raises(ConfigError, match=r"tp_plan\['blocks.\*.ffn'\] matches no module"):
        resolve_plan(TinyGPT(), {"blocks.*.ffn": "colwise"})
