"""Built-in training workloads for `gradsync bench train`: models and synthetic data, no downloads.

Each workload is a model, a dataset of a fixed size and a loss. The data is synthetic but
learnable (labels come from a fixed random "teacher"), so the final loss means something when
configurations are compared, and the model shapes are the ones that matter for communication:

- resnet18: the CIFAR variant of ResNet-18 (11.2M parameters, 3x32x32 images), conv-heavy.
- gpt: a small decoder-only transformer on synthetic token streams, matmul-heavy
  with one large embedding gradient (5.3M parameters); its blocks fit the standard
  tensor-parallel plan, and its forward is its children in order, so a pipeline cuts it.
- gpt-lora: the same GPT fine-tuned with LoRA (base frozen, rank-8 adapters on attention and
  MLP: 0.2M trainable parameters), the parameter-efficient case whose gradients are tiny.
- mlp: a 3-layer perceptron (0.6M parameters) that makes tests and quick checks cheap.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset


@dataclass(frozen=True)
class Workload:
    name: str
    build_model: Callable[[], nn.Module]
    build_dataset: Callable[[int], Dataset]  # (number of samples) -> (inputs, targets) samples
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (model output, targets) -> mean loss
    # Where a pipeline of N stages cuts the model, by N (gradsync.parallel.pp); absent: not cut.
    split_points: dict[int, tuple[str, ...]] = field(default_factory=dict)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        inputs, targets = batch
        return self.loss_fn(model(inputs), targets)


# -- ResNet-18, CIFAR variant (3x3 stem, no max-pool) --------------------------------------------


class BasicBlock(nn.Module):
    def __init__(self, inputs: int, outputs: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.shortcut = nn.Sequential()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet18(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        layers, inputs = [], 64
        for outputs, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [BasicBlock(inputs, outputs, stride), BasicBlock(outputs, outputs, 1)]
            inputs = outputs
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.adaptive_avg_pool2d(self.layers(self.stem(x)), 1).flatten(1))


def _images(samples: int) -> Dataset:
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(samples, 3, 32, 32, generator=generator)
    teacher = torch.randn(3 * 32 * 32, 10, generator=generator)
    return TensorDataset(images, (images.flatten(1) @ teacher).argmax(1))


def _classification_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels)


# -- a small GPT ---------------------------------------------------------------------------------

VOCAB, CONTEXT = 4096, 64


class Attention(nn.Module):
    """Causal self-attention with separate q/k/v/o projections, whose heads are split with -1:
    under tensor parallelism each rank keeps its share of the heads (the standard plan's q/k/v
    column-wise, o row-wise)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = (proj(x).view(batch, length, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(batch, length, -1))


class MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(width), Attention(width, heads)
        self.norm2, self.mlp = nn.LayerNorm(width), MLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Embedding(nn.Module):
    """Token embeddings plus learned positions."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, width)
        self.positions = nn.Parameter(torch.zeros(CONTEXT, width))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tokens(tokens) + self.positions[: tokens.shape[1]]


class TinyGPT(nn.Module):
    """A decoder-only transformer (pre-norm blocks, learned positions): 5.3M parameters.

    Written as its children in order (embedding, blocks, norm, head), as a pipeline needs to cut
    it between blocks."""

    def __init__(self, width: int = 256, layers: int = 4, heads: int = 4) -> None:
        super().__init__()
        self.embed = Embedding(width)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(tokens))))


class LoRALinear(nn.Module):
    """A frozen Linear plus a trainable rank-r update: W x + (alpha / r) B A x, B starting at
    zero so training starts from the base model."""

    def __init__(self, base: nn.Linear, rank: int = 8, alpha: float = 16.0) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Linear(base.in_features, rank, bias=False)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False)
        nn.init.zeros_(self.lora_b.weight)
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x)) * self.scale


def lora_gpt(rank: int = 8) -> nn.Module:
    """The GPT fine-tuned with LoRA: every weight frozen, rank-8 adapters on attention's q/k/v/o
    and the MLP's up/down. Only the adapters get gradients, so DDP reduces only them."""
    model = TinyGPT().requires_grad_(False)
    for block in model.blocks:
        for owner, names in ((block.attn, ("q", "k", "v", "o")), (block.mlp, ("up", "down"))):
            for name in names:
                setattr(owner, name, LoRALinear(getattr(owner, name), rank))
    return model


def _token_streams(samples: int) -> Dataset:
    # A fixed random bigram table: the next token depends on the current one, so there is
    # something to learn beyond unigram frequencies.
    generator = torch.Generator().manual_seed(0)
    successor = torch.randint(0, VOCAB, (VOCAB, 4), generator=generator)
    tokens = torch.empty(samples, CONTEXT + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, VOCAB, (samples,), generator=generator)
    for position in range(1, CONTEXT + 1):
        choice = torch.randint(0, 4, (samples,), generator=generator)
        tokens[:, position] = successor[tokens[:, position - 1], choice]
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def _language_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# -- a small MLP ---------------------------------------------------------------------------------


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256), nn.ReLU(), nn.Linear(256, 10))


def _vectors(samples: int) -> Dataset:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(samples, 256, generator=generator)
    teacher = torch.randn(256, 10, generator=generator)
    return TensorDataset(inputs, (inputs @ teacher).argmax(1))


WORKLOADS = {
    "resnet18": Workload("resnet18", ResNet18, _images, _classification_loss),
    # The head (a 256 x 4096 matmul per token) costs about a block and a third: the last stage
    # takes one block fewer.
    "gpt": Workload("gpt", TinyGPT, _token_streams, _language_loss,
                    split_points={2: ("blocks.3",), 4: ("blocks.1", "blocks.2", "blocks.3")}),
    "gpt-lora": Workload("gpt-lora", lora_gpt, _token_streams, _language_loss),
    "mlp": Workload("mlp", _mlp, _vectors, _classification_loss, split_points={2: ("2",), 4: ("1", "2", "4")}),
}
