"""Every trainer guarantee under each strategy, against a single-process float64 reference:
accumulation that reduces once per optimizer step, the big-batch gradient kept through agreed
skips (a window's boundary batch included), non-finite steps skipped on every rank, clipping
over DTensors, uneven evaluation that never hangs, and bytes per step metered."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import gradsync
from tests.harness import launch
from tests.parallel.reference import one_process_sgd

WIDTH, SAMPLES, BATCH, ACCUMULATION, LR, CLIP = 8, 45, 3, 2, 0.05, 0.5
CASES = [("ddp", 2), ("fsdp", 2), ("fsdp", 4), ("hsdp", 4), ("tp", 2), ("fsdp+tp", 4)]
IDS = [f"{p}-{n}" for p, n in CASES]


class Block(nn.Module):
    """An MLP block the standard tensor-parallel plan recognises (up column-wise, down row-wise)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Regression(Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(2)
        self.x = torch.randn(SAMPLES, WIDTH, dtype=torch.float64, generator=generator)
        self.y = torch.sin(self.x.sum(1, keepdim=True))
        self.bad: set[int] = set()

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int):
        x = self.x[i].clone()
        if i in self.bad:
            x[0] = float("nan")
        return x, self.y[i], i


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return Net().double()


def _options(parallel: str) -> dict:
    return {"strategy": parallel, **({"shard_size": 2} if parallel == "hsdp" else {}),
            **({"tp_size": 2} if parallel == "fsdp+tp" else {})}


def _train(parallel, skip_batches=(), nan_samples=()):
    trainer = gradsync.setup(accumulation_steps=ACCUMULATION, seed=0, max_grad_norm=CLIP, parallel=_options(parallel),
                             metrics={"log_every": 2, "progress": False, "tensorboard": False})
    dataset = Regression()
    if trainer.rank == trainer.world_size - 1:
        dataset.bad = set(nan_samples)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer, loader = trainer.prepare(model, optimizer, dataset, batch_size=BATCH)
    strategy = trainer._strategy
    applied, reductions_at = [], []
    for _ in trainer.epochs(2):
        for x, y, idx in loader:
            i = loader.position - 1
            if trainer.agree_any(i in skip_batches and trainer.rank == 0):
                continue
            before = strategy.reductions
            with trainer.step() as step:
                loss = F.mse_loss(model(x), y)
                if trainer.agree_any(~torch.isfinite(loss)):
                    continue
                step.backward(loss)
                applied.append((trainer.optimizer_steps, idx.tolist()))
            if strategy.reductions != before:
                reductions_at.append((loader.epoch, i, strategy.reductions - before))
    # Evaluation: 45 samples leave the data-parallel ranks uneven shares; every rank still runs
    # as many (collective) forwards, and each sample counts once.
    correct = total = 0.0
    for x, y, _ in trainer.eval_loader(Regression(), batch_size=4):
        error = (trainer.unwrap(model)(x) - y).abs()
        correct, total = correct + float((error < 0.5).sum()), total + len(y)
    counted = trainer.sum_over_ranks(correct, total)
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in trainer.unwrap(model).parameters()]
    summary = trainer.summary()
    trainer.close()
    return {
        "params": [p.detach().reshape(-1).tolist() for p in full], "applied": applied, "reductions_at": reductions_at,
        "batches": len(loader), "summary": summary, "reductions": strategy.reductions, "evaluated": counted[1], "data_rank": strategy.placement.data_rank,
    }


def reference_params(results):
    dataset = Regression()
    model = one_process_sgd(results, make_model(), dataset.x, dataset.y, LR, CLIP)
    return [p.detach().reshape(-1).tolist() for p in model.parameters()]


def assert_params_close(actual, expected):
    for a, e in zip(actual, expected):
        assert torch.allclose(torch.tensor(a), torch.tensor(e), rtol=0, atol=1e-12), (a[:3], e[:3])


@pytest.mark.launches
@pytest.mark.parametrize(("parallel", "ranks"), CASES, ids=IDS)
def test_accumulation_reduces_once_and_skips_keep_the_big_batch_gradient(parallel, ranks):
    # Batch 1 is inside a window, 3 ends one (its gradients were never reduced), the epoch's
    # last ends the short last window; only rank 0 decides, every rank skips.
    results = launch(_train, ranks, parallel=parallel, skip_batches=[1, 3], timeout=150)
    first = results[0]
    for result in results:
        assert result["params"] == first["params"], "every rank holds the same model"
    assert_params_close(first["params"], reference_params(results))
    boundaries = {b for b in range(first["batches"]) if b % ACCUMULATION == ACCUMULATION - 1 or b == first["batches"] - 1}
    if parallel != "tp" and ranks > 1:
        # One reduction pass per optimizer step, at the window's last batch or, when it was
        # skipped, when the window closed; none on the other micro-batches.
        assert first["reductions"] == first["summary"]["steps"] == 2 * len(boundaries)
        last = first["batches"] - 1
        for epoch in (0, 1):
            passes = [(b, n) for e, b, n in first["reductions_at"] if e == epoch]
            assert all(n == 1 for _, n in passes)
            # Skipped boundaries 1 and 3: their windows are reduced when the next micro-step
            # opens (or, after the epoch's last batch, when the epoch ends).
            assert [b for b, _ in passes] == sorted((boundaries - {1, 3}) | ({2, 4} - {last + 1}))
    else:
        assert first["reductions_at"] == [], "one copy of the model: no gradient to reduce"
    assert first["evaluated"] == SAMPLES, "every evaluation sample once"
    assert first["summary"]["parallel"]["strategy"] == parallel


@pytest.mark.launches
@pytest.mark.parametrize(("parallel", "ranks"), [("fsdp", 2), ("fsdp+tp", 4)], ids=["fsdp-2", "fsdp+tp-4"])
def test_a_nan_loss_on_one_rank_is_skipped_by_all(parallel, ranks):
    results = launch(_train, ranks, parallel=parallel, nan_samples=list(range(0, SAMPLES, 7)), timeout=150)
    for result in results:
        assert result["params"] == results[0]["params"]
        assert all(torch.isfinite(torch.tensor(p)).all() for p in result["params"])
    assert len(results[0]["applied"]) < 2 * results[0]["batches"], "some micro-steps were skipped"
    assert_params_close(results[0]["params"], reference_params(results))


def _metered(parallel):
    trainer = gradsync.setup(parallel=_options(parallel), seed=0, metrics={"log_every": 1, "progress": False, "tensorboard": False})
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer, loader = trainer.prepare(model, optimizer, Regression(), batch_size=BATCH)
    rows = []
    for _ in trainer.epochs(1):
        for x, y, _ in loader:
            with trainer.step() as step:
                step.backward(F.mse_loss(model(x), y))
            if step.stepped:
                record = trainer._finished
                rows.append({**record.comm, "samples": record.samples, "exposed": len(record.exposed),
                             "estimate_s": record.exposed_estimate_s, "step": record.step,
                             "exposed_s": record.exposed_seconds(trainer._clock),
                             "step_s": trainer._clock.seconds(record.start, record.end)})
    trainer.close()
    return rows


@pytest.mark.launches
@pytest.mark.parametrize(("parallel", "ranks"), [("fsdp", 2), ("hsdp", 4)], ids=["fsdp-2", "hsdp-4"])
def test_fsdp_meters_the_bytes_of_every_gather_and_reduction(parallel, ranks):
    rows = launch(_metered, ranks, parallel=parallel, timeout=150)[0]
    shard_group = 2
    # FSDP pads each parameter's first dimension to a multiple of the shard group (the head's
    # single output row becomes two): bytes move for the padded sizes.
    parameters = 8 * sum(-(-p.shape[0] // shard_group) * shard_group * p[0].numel() for p in make_model().parameters())
    for comm in rows:
        # Sized as nccl-tests does: forward and backward gather every unit (reshard_after_forward),
        # the reduce-scatter takes every gradient.
        assert comm["all_gather_bytes"] == 2 * parameters
        assert comm["reduce_scatter_bytes"] == parameters
        # HSDP all-reduces each shard across the replicas; FSDP has none.
        assert comm["all_reduce_bytes"] == (pytest.approx(parameters / shard_group) if parallel == "hsdp" else 0)


@pytest.mark.launches
def test_tensor_parallelism_meters_its_exchanges_on_a_sample_of_steps_and_carries_them_between():
    from gradsync.parallel.tp import METERED_EVERY, METERED_FIRST_STEPS

    rows = launch(_metered, 2, parallel="tp", timeout=150)[0]
    assert len(rows) > METERED_EVERY
    last = None
    for comm in rows:
        # Per micro-batch: each block's row-wise `down` all-reduces its output in forward, and
        # the second block's column-wise `up` all-reduces its input's gradient in backward (the
        # first block's input, the data, needs none): 3 x batch x WIDTH float64 values.
        assert comm["all_reduce_bytes"] == 3 * comm["samples"] * WIDTH * 8
        assert comm["all_gather_bytes"] == comm["reduce_scatter_bytes"] == 0
        if comm["step"] <= METERED_FIRST_STEPS or comm["step"] % METERED_EVERY == 0:
            assert comm["exposed"] >= 1 and comm["estimate_s"] == 0, "a metered step's waits are measured"
            last = comm
        else:
            # Between samples, the last metered step's waits stand for the step's, within the step's
            # own span (a step shorter than the estimate is all exposed, never more).
            assert comm["exposed"] == 0 and comm["estimate_s"] > 0 and last["exposed_s"] > 0, comm
            assert comm["exposed_s"] == min(comm["estimate_s"], comm["step_s"]), comm


def _refused(**options):
    try:
        gradsync.setup(**options)
    except gradsync.ConfigError as error:
        return str(error)
    return None


@pytest.mark.parametrize(("options", "says"), [
    ({"parallel": "fsdp", "precision": "fp16"}, "Use precision='bf16'"),
    ({"parallel": "fsdp", "ddp": {"compression": "powersgd"}}, "'bf16' maps to FSDP's reduce_dtype"),
    ({"parallel": "tp", "ddp": {"compression": "bf16"}}, "nothing to compress"),
    ({"parallel": "fsdp", "ddp": {"find_unused_parameters": True}}, "these are DDP's options"),
    ({"parallel": "hsdp", "ddp": {"bucket_cap_mb": 50}}, "ddp.bucket_cap_mb set with parallel='hsdp'"),
    ({"parallel": "fsdp+tp"}, "needs parallel.tp_size"),
    ({"parallel": "pipeline"}, "is unknown"),
    ({"parallel": {"strategy": "fsdp", "tp_size": 2}}, "applies to strategies 'tp' and 'fsdp+tp' only"),
])
def test_options_that_cannot_work_with_a_strategy_are_refused_with_the_reason(options, says):
    error = _refused(**options)
    assert error is not None and says in error


@pytest.mark.launches
@pytest.mark.parametrize(("parallel", "says"), [
    ({"strategy": "hsdp"}, "Give parallel.shard_size"),
    ({"strategy": "hsdp", "shard_size": 3}, "does not divide"),
    ({"strategy": "tp", "tp_size": 2}, "use parallel={'strategy': 'fsdp+tp', 'tp_size': 2}"),
])
def test_a_mesh_that_does_not_fit_the_world_is_refused_on_every_rank(parallel, says):
    errors = launch(_refused, 4, parallel=parallel)
    assert all(error is not None and says in error for error in errors)


def _mixed_precision(precision, compression):
    trainer = gradsync.setup(parallel="fsdp", precision=precision, ddp={"compression": compression}, seed=0,
                             metrics={"log_every": 1, "progress": False, "tensorboard": False})
    model = make_model().float()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer, loader = trainer.prepare(model, optimizer, Regression(), batch_size=BATCH)
    seen, losses, comm = {}, [], {}
    def note_dtype(module, inputs, output):
        seen.setdefault("compute", str(output.dtype))

    model.head.register_forward_hook(note_dtype)
    for _ in trainer.epochs(1):
        for x, y, _ in loader:
            with trainer.step() as step:
                loss = F.mse_loss(model(x.float()).float(), y.float())
                step.backward(loss)
            losses.append(loss.item())
            comm = trainer._finished.comm
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    trainer.close()
    return {"compute": seen["compute"], "params": dtypes, "losses": losses,
            "gathered": comm["all_gather_bytes"], "reduced": comm["reduce_scatter_bytes"]}


@pytest.mark.launches
def test_fsdp_mixed_precision_gathers_and_computes_in_bf16_and_reduces_as_asked():
    fp32 = launch(_mixed_precision, 2, precision="fp32", compression="none")[0]
    bf16 = launch(_mixed_precision, 2, precision="bf16", compression="none")[0]
    bf16_grads = launch(_mixed_precision, 2, precision="bf16", compression="bf16")[0]
    assert fp32["compute"] == "torch.float32" and bf16["compute"] == "torch.bfloat16"
    assert bf16["params"] == ["torch.float32"], "the optimizer steps fp32 shards"
    assert bf16["gathered"] == fp32["gathered"] / 2, "parameters are gathered in bf16"
    assert bf16["reduced"] == fp32["reduced"], "gradients are reduced in fp32 by default"
    assert bf16_grads["reduced"] == fp32["reduced"] / 2, "compression='bf16' reduces them in bf16"
    # Same training, to bf16's precision.
    assert all(abs(a - b) < 0.05 * max(abs(b), 1e-3) + 1e-2 for a, b in zip(bf16["losses"], fp32["losses"]))


class FullHeadCountAttention(nn.Module):
    """Splits heads with the model's head count, as much single-GPU code does."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = 2
        self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]
        q, k, v = (proj(x).view(batch, self.heads, WIDTH // self.heads) for proj in (self.q, self.k, self.v))
        return self.o(F.scaled_dot_product_attention(q, k, v).reshape(batch, -1))


def _full_head_count():
    trainer = gradsync.setup(parallel="tp", seed=0, metrics={"progress": False, "tensorboard": False})
    model = FullHeadCountAttention().double()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer, loader = trainer.prepare(model, optimizer, Regression(), batch_size=BATCH)
    try:
        for _ in trainer.epochs(1):
            for x, y, _ in loader:
                with trainer.step() as step:
                    step.backward(F.mse_loss(model(x).sum(1, keepdim=True), y))
    except gradsync.ConfigError as error:
        return str(error)
    return None


@pytest.mark.launches
def test_attention_that_splits_heads_by_their_full_count_is_explained_under_tensor_parallelism():
    for error in launch(_full_head_count, 2, timeout=150):
        assert error is not None and "1/2 of what it asked for" in error and "view(batch, length, -1, head_dim)" in error


def _adamw_multi_tensor(steps):
    trainer = gradsync.setup(parallel="tp", seed=0, metrics={"progress": False, "tensorboard": False})
    model = make_model()
    # foreach=True is what torch picks by itself on CUDA; the head stays a plain tensor beside
    # the blocks' DTensors, and one _foreach_ call cannot take both.
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    model, optimizer, loader = trainer.prepare(model, optimizer, Regression(), batch_size=BATCH)
    applied = []
    for _ in trainer.epochs(1):
        for x, y, idx in loader:
            if len(applied) == steps:
                break
            with trainer.step() as step:
                step.backward(F.mse_loss(model(x), y))
            applied.append(idx.tolist())
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in trainer.unwrap(model).parameters()]
    trainer.close()
    return {"params": [p.detach().reshape(-1).tolist() for p in full], "applied": applied,
            "foreach": [group["foreach"] for group in optimizer.param_groups]}


@pytest.mark.launches
def test_tensor_parallelism_steps_a_multi_tensor_optimizer_over_split_and_unsplit_layers_as_one_process_would():
    results = launch(_adamw_multi_tensor, 2, steps=4, timeout=150)
    assert results[0]["applied"] == results[1]["applied"]  # a tensor-parallel group shares its batches
    assert results[0]["foreach"] == [False]
    dataset, model = Regression(), make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    for indices in results[0]["applied"]:
        optimizer.zero_grad()
        F.mse_loss(model(dataset.x[indices]), dataset.y[indices]).backward()
        optimizer.step()
    expected = [p.detach().reshape(-1).tolist() for p in model.parameters()]
    for result in results:
        assert_params_close(result["params"], expected)
