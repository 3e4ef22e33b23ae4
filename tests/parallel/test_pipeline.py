"""Pipelines (`parallel="pp"`, "pp+ddp"): the cut into stages, and on real process groups the
trainer's guarantees: the big-batch gradient through micro-batches, accumulation and clipping
(against a one-process float64 reference), both schedules and the interleaved one, DDP across
pipelines, evaluation outputs on every rank, the measured bubble, fp16's skips agreed across
stages, and exact resume (on the same split and on another)."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import gradsync
from gradsync.errors import ConfigError
from gradsync.parallel import ParallelConfig
from gradsync.parallel.pp import PipelineLayout, StageModule, pipeline_units, split_batch
from tests.checkpoint.train_script import train, train_expecting_error
from tests.harness import launch
from tests.parallel.reference import one_process_sgd

SAMPLES, BATCH, ACCUMULATION, LR, CLIP = 36, 4, 2, 0.05, 0.5


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(),
                         nn.Linear(12, 1)).double()


class Regression(Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(2)
        self.x = torch.randn(SAMPLES, 6, dtype=torch.float64, generator=generator)
        self.y = torch.sin(self.x.sum(1, keepdim=True))

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


# -- the cut (no processes) -----------------------------------------------------------------------


def test_stages_are_runs_of_units_and_keep_the_models_parameter_names():
    model = nn.Sequential(OrderedDict(body=nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 3)), head=nn.Linear(3, 1)))
    assert pipeline_units(model, None) == [["body"], ["head"]]
    assert pipeline_units(model, ("body.2",)) == [["body.0", "body.1"], ["body.2", "head"]]
    assert pipeline_units(model, ()) == [["body", "head"]]
    stage = StageModule(model, ["body.2", "head"])
    assert [name for name, _ in stage.named_parameters()] == ["body.2.weight", "body.2.bias", "head.weight", "head.bias"]
    x = torch.randn(4, 3)
    assert torch.equal(stage(x), model.head(model.body[2](x)))


class TwoPaths(nn.Module):
    """A forward that is not its children in order: a pipeline cannot cut it by children alone."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.a = nn.Linear(2, 2)

    def forward(self, x):
        return self.a(x) * self.scale


@pytest.mark.parametrize(("model", "points", "says"), [
    (nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), ("5",), "not a module of the model"),
    (nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), ("0",), "none at the very first"),
    (nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)), ("2", "1"), "in forward order"),
    (nn.Sequential(nn.Linear(2, 2), nn.MultiheadAttention(2, 1)), ("1.out_proj",), "inside an nn.Sequential"),
    (TwoPaths(), None, "parameters or buffers of its own"),
])
def test_a_cut_that_cannot_work_is_refused_with_how_to_fix_it(model, points, says):
    with pytest.raises(ConfigError, match=says):
        pipeline_units(model, points)


def test_pipeline_options_are_checked_at_setup():
    with pytest.raises(ConfigError, match="pp_size"):
        ParallelConfig(strategy="pp+ddp")
    with pytest.raises(ConfigError, match="stages_per_rank >= 2"):
        ParallelConfig(strategy="pp", schedule="interleaved-1f1b")
    with pytest.raises(ConfigError, match="applies to strategies 'pp'"):
        ParallelConfig(strategy="ddp", microbatches=4)
    with pytest.raises(ConfigError, match="unknown"):
        ParallelConfig(strategy="pp", schedule="zero-bubble")
    assert ParallelConfig.of({"strategy": "pp", "split_points": "3"}).split_points == ("3",)


def test_fp16_is_offered_to_pipelines_and_compression_is_refused_with_the_reason():
    from gradsync.config import TrainerConfig

    # The stages' scalers agree on overflows, so fp16 (on CUDA) is allowed, unlike under FSDP.
    TrainerConfig.from_kwargs(parallel="pp", precision="fp16")
    with pytest.raises(ConfigError, match="fp16 needs a loss scaler"):
        TrainerConfig.from_kwargs(parallel="fsdp", precision="fp16")
    with pytest.raises(ConfigError, match="inside torch's schedule"):
        TrainerConfig.from_kwargs(parallel={"strategy": "pp+ddp", "pp_size": 2}, ddp={"compression": "powersgd"})
    TrainerConfig.from_kwargs(parallel={"strategy": "pp+ddp", "pp_size": 2}, ddp={"bucket_cap_mb": 5.0})
    with pytest.raises(ConfigError, match="bucket_cap_mb"):
        TrainerConfig.from_kwargs(parallel="pp", ddp={"bucket_cap_mb": 5.0})


def test_a_batch_is_cut_into_equal_micro_batches():
    assert split_batch(8, 4, full=True) == 4
    assert split_batch(6, 4, full=False) == 3, "a short last batch: the most equal micro-batches up to 4"
    assert split_batch(6, 4, full=False, multiple_of=2) == 2
    with pytest.raises(ConfigError, match="multiple of 3"):
        split_batch(8, 3, full=True)
    with pytest.raises(gradsync.GradsyncError, match="remainder='drop'"):
        split_batch(3, 4, full=False, multiple_of=2)


def test_the_ideal_bubble_is_the_textbook_share():
    layout = PipelineLayout(pp_size=4, dp_size=1, pp_rank=0, dp_rank=0, stages_per_rank=1)
    assert layout.ideal_bubble(8) == pytest.approx(3 / 11)
    interleaved = PipelineLayout(pp_size=2, dp_size=1, pp_rank=1, dp_rank=0, stages_per_rank=2)
    assert interleaved.stage_indexes() == [1, 3] and interleaved.ideal_bubble(4) == pytest.approx(1 / 9)


# -- training on real process groups ------------------------------------------------------------


def _train(parallel: dict, skip_batches=(), checkpoint_dir=None, stop_after_step=None, momentum=0.0):
    checkpoint = {"dir": checkpoint_dir, "every_steps": 1, "resume": "auto"} if checkpoint_dir else {}
    trainer = gradsync.setup(accumulation_steps=ACCUMULATION, seed=0, max_grad_norm=CLIP, parallel=parallel,
                             checkpoint=checkpoint, metrics={"log_every": 1, "progress": False, "tensorboard": False})
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum)
    model, optimizer, loader = trainer.prepare(model, optimizer, Regression(), batch_size=BATCH)
    applied, rows, losses = [], [], []
    for _ in trainer.epochs(2):
        for x, y, idx in loader:
            if trainer.agree_any(loader.position - 1 in skip_batches and trainer.rank == 0):
                continue
            with trainer.step() as step:
                losses.append(float(step.forward_backward(x, y, F.mse_loss)))
                applied.append((trainer.optimizer_steps, idx.tolist()))
            if step.stepped:
                record = trainer._finished
                rows.append({**record.comm, "exposed_estimate_s": record.exposed_estimate_s})
                if stop_after_step is not None and trainer.optimizer_steps >= stop_after_step:
                    break
        if stop_after_step is not None and trainer.optimizer_steps >= stop_after_step:
            break
    with torch.no_grad():
        outputs = model(Regression().x[:5])
    with pytest.raises(gradsync.GradsyncError, match="forward_backward"):
        model(Regression().x[:5])
    params = {name: p.detach().reshape(-1).tolist() for name, p in model.shard.named_parameters()}
    summary = trainer.summary()
    trainer.close()
    return {"params": params, "applied": applied, "rows": rows, "losses": losses, "outputs": outputs.tolist(),
            "summary": summary, "data_rank": trainer._strategy.placement.data_rank,
            "optimizer_params": sum(len(g["params"]) for g in optimizer.param_groups)}


def reference(results):
    """The one-process model's parameters by name, and its outputs on the first samples."""
    dataset = Regression()
    model = one_process_sgd(results, make_model(), dataset.x, dataset.y, LR, CLIP)
    with torch.no_grad():
        outputs = model(dataset.x[:5])
    return {name: p.detach().reshape(-1) for name, p in model.named_parameters()}, outputs


CASES = {
    "gpipe-2": ({"strategy": "pp", "schedule": "gpipe", "split_points": ("4",)}, 2),
    "1f1b-2": ({"strategy": "pp", "schedule": "1f1b", "split_points": ("4",), "microbatches": 2}, 2),
    "interleaved-2x2": ({"strategy": "pp", "schedule": "interleaved-1f1b", "stages_per_rank": 2,
                         "split_points": ("2", "4", "6")}, 2),
    "pp+ddp-2x2": ({"strategy": "pp+ddp", "pp_size": 2, "split_points": ("4",)}, 4),
    "1f1b-4": ({"strategy": "pp", "split_points": ("2", "4", "6")}, 4),
}


@pytest.mark.launches
@pytest.mark.parametrize("case", list(CASES))
def test_a_pipeline_trains_the_big_batch_gradient_of_one_process(case):
    parallel, ranks = CASES[case]
    # Batch 1 of each epoch is skipped by every rank (agreed): its window still steps on the rest.
    results = launch(_train, ranks, parallel=parallel, skip_batches=[1], timeout=180)
    expected, outputs = reference(results)
    held: dict[str, list[float]] = {}
    for result in results:
        for name, values in result["params"].items():
            if name in held:
                assert values == held[name], f"the pipelines' copies of {name} are identical"
            held[name] = values
        assert result["optimizer_params"] == len(result["params"]), "each rank's optimizer steps its stages only"
    assert sorted(held) == sorted(expected), "every parameter is held by some stage, under its own name"
    for name, values in held.items():
        assert torch.allclose(torch.tensor(values, dtype=torch.float64), expected[name], rtol=0, atol=1e-12), name
    for result in results:
        assert torch.allclose(torch.tensor(result["outputs"], dtype=torch.float64), outputs, rtol=0, atol=1e-12), \
            "evaluation gives every rank the model's outputs"
        assert result["losses"] == results[0]["losses"][: len(result["losses"])] or result["data_rank"] != 0
    first = results[0]
    assert first["summary"]["parallel"]["strategy"] == parallel["strategy"]
    # Each rank measured its compute within the schedule; the rest of the schedule's time is the
    # step's exposed communication (the bubble and the transfers).
    for row in first["rows"]:
        assert 0 < row["pipeline_compute_s"] <= row["pipeline_schedule_s"]
        assert row["exposed_estimate_s"] == pytest.approx(row["pipeline_schedule_s"] - row["pipeline_compute_s"], abs=1e-9)
        assert row["p2p_bytes"] > 0


def _agreed_overflow():
    """fp16's scaler on a pipeline (the CPU cannot autocast fp16, so the scaler is driven by hand):
    only rank 1's gradient overflows, and every rank skips the step and lowers its scale."""
    import torch.distributed as dist

    from gradsync.precision import MixedPrecision

    dist.init_process_group("gloo")
    weight = nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    precision = MixedPrecision("fp16", torch.device("cpu"), agree_on_overflow=True)
    scale = precision.loss_scale()
    assert scale is not None
    loss = scale(weight.sum())
    loss.backward()
    if dist.get_rank() == 1:
        weight.grad[0] = float("inf")
    before = precision.scaler.get_scale()
    precision.unscale_(optimizer)
    applied = precision.step(optimizer)
    result = {"applied": applied, "weight": weight.tolist(), "scale_fell": precision.scaler.get_scale() < before}
    dist.destroy_process_group()
    return result


@pytest.mark.launches
def test_an_overflow_on_one_stage_skips_the_step_on_every_stage():
    results = launch(_agreed_overflow, 2, timeout=60)
    assert [r["applied"] for r in results] == [False, False]
    assert all(r["weight"] == [1.0, 1.0, 1.0] and r["scale_fell"] for r in results)


# -- checkpoints ------------------------------------------------------------------------------------


@pytest.mark.launches
def test_an_interrupted_pipeline_resumes_bitwise_and_on_another_split(tmp_path):
    # train_script's model: Linear, ReLU, Dropout, Linear; dropout draws from each rank's stream.
    split = {"strategy": "pp", "split_points": ("3",)}
    uninterrupted = launch(train, 2, checkpoint_dir=None, parallel=split, timeout=150)
    steps = uninterrupted[0]["steps"]
    checkpoints = tmp_path / "ckpt"
    launch(train, 2, checkpoint_dir=str(checkpoints), parallel=split, stop_after_step=steps // 2 + 1, timeout=150)
    resumed = launch(train, 2, checkpoint_dir=str(checkpoints), parallel=split, timeout=150)
    assert [r["sha256"] for r in resumed] == [r["sha256"] for r in uninterrupted], "each stage bitwise equal"
    assert resumed[0]["summary_steps"] == steps and not [w for r in resumed for w in r["warnings"]]

    # A DDP checkpoint keeps one copy of the optimizer state: a pipeline refuses it and says which to use.
    ddp_checkpoints = tmp_path / "ddp"
    launch(train, 2, checkpoint_dir=str(ddp_checkpoints), parallel="ddp", stop_after_step=4, timeout=150)
    refused = launch(train_expecting_error, 2, checkpoint_dir=str(ddp_checkpoints), parallel=split, timeout=150)
    assert "error" in refused[0], refused[0]
    assert "written with parallel='ddp'" in refused[0]["error"] and "per parameter" in refused[0]["error"]


@pytest.mark.launches
def test_a_pipeline_checkpoint_resumes_under_another_split(tmp_path):
    # Optimizer state is kept per parameter name, so a checkpoint loads whichever stage now holds
    # each parameter. Momentum makes a lost state show; only the clipping norm's sum runs in
    # another order, so the result equals the uninterrupted run's to rounding.
    written, resumed = {"strategy": "pp", "split_points": ("4",)}, {"strategy": "pp", "split_points": ("2", "4", "6")}
    uninterrupted = launch(_train, 2, parallel=written, momentum=0.9, timeout=150)
    checkpoints = str(tmp_path / "ckpt")
    launch(_train, 2, parallel=written, momentum=0.9, checkpoint_dir=checkpoints, stop_after_step=5, timeout=150)
    after = launch(_train, 4, parallel=resumed, momentum=0.9, checkpoint_dir=checkpoints, timeout=150)
    expected = {name: values for result in uninterrupted for name, values in result["params"].items()}
    held = {name: values for result in after for name, values in result["params"].items()}
    assert sorted(held) == sorted(expected)
    for name, values in held.items():
        assert torch.allclose(torch.tensor(values), torch.tensor(expected[name]), rtol=0, atol=1e-10), name
    # Another world size: each rank's own state (its metrics among it) starts afresh, so this run counts its own steps.
    assert after[0]["summary"]["steps"] == uninterrupted[0]["summary"]["steps"] - 5
