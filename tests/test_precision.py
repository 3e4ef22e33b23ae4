"""Mixed precision: autocast, fp16 loss scaling, unscale before clipping, counted skips."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import gradsync
from gradsync import ConfigError
from tests.harness import launch


def _bf16_step():
    trainer = gradsync.setup(precision="bf16", seed=0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(24, 8, generator=g), torch.randn(24, 2, generator=g))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    model, optimizer, loader = trainer.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), data, batch_size=4)
    seen = {}
    for _ in trainer.epochs(1):
        for x, y in loader:
            with trainer.step() as step:
                out = model(x)
                seen["forward_dtype"] = str(out.dtype)
                step.backward(F.mse_loss(out.float(), y))
                seen["grad_dtype"] = str(next(trainer.unwrap(model).parameters()).grad.dtype)
    seen["param_dtype"] = str(next(trainer.unwrap(model).parameters()).dtype)
    seen["scaler"] = trainer._precision.scaler is not None
    seen["params"] = [p.detach().reshape(-1).tolist() for p in trainer.unwrap(model).parameters()]
    trainer.close()
    return seen


@pytest.mark.launches
def test_bf16_autocasts_the_forward_and_keeps_fp32_weights_and_grads(world_size):
    results = launch(_bf16_step, world_size)
    for seen in results:
        assert seen["forward_dtype"] == "torch.bfloat16"
        assert seen["grad_dtype"] == seen["param_dtype"] == "torch.float32"
        assert seen["scaler"] is False, "bf16 needs no loss scaling"
        assert seen["params"] == results[0]["params"]


def test_fp16_on_cpu_is_refused_with_the_alternative():
    with pytest.raises(ConfigError, match="Use precision='bf16'"):
        gradsync.setup(precision="fp16", device="cpu")


@pytest.mark.launches
def test_fp16_scaling_unscales_before_clipping_and_counts_overflow_skips(monkeypatch, tmp_path, capfd):
    # fp16 training is a CUDA feature; its CPU refusal is tested above. The scaling logic is the
    # same on every device, so this test lifts the refusal to exercise it with CPU autocast.
    monkeypatch.setattr("gradsync.trainer.check_precision_supported", lambda precision, device: None)
    trainer = gradsync.setup(precision="fp16", max_grad_norm=1e6, run_dir=str(tmp_path), metrics={"log_every": 1})
    torch.manual_seed(0)
    x = torch.randn(8, 4)
    x[4:] = 6e4  # the second batch overflows fp16
    data = TensorDataset(x, torch.zeros(8, 1))
    model = torch.nn.Linear(4, 1)
    reference = torch.nn.Linear(4, 1)
    reference.load_state_dict(model.state_dict())
    model, optimizer, loader = trainer.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.01), data, batch_size=4, shuffle=False
    )
    stepped = []
    for _ in trainer.epochs(1):
        for xb, yb in loader:
            before = [p.detach().clone() for p in model.parameters()]
            with trainer.step() as step:
                step.backward(F.mse_loss(model(xb).float(), yb))
            stepped.append(step.stepped)
            if len(stepped) == 1:
                # What an unscaled fp16 step computes: the recorded norm must match it, not be
                # 65536 times larger (clipping a scaled gradient clips nothing useful).
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = F.mse_loss(reference(xb).float(), yb)
                loss.backward()
                true_norm = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in reference.parameters()]))
                assert trainer._finished.grad_norm == pytest.approx(true_norm.item(), rel=1e-2)
            else:
                assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "a skipped step must not move weights"
    summary = trainer.summary()
    trainer.close()
    assert stepped == [True, False]
    assert summary["skipped_steps"] == 1 and summary["skip_reasons"] == {"overflow": 1}
    assert trainer._precision.scaler.get_scale() == 32768.0, "the scale halves after an overflow"
    assert "optimizer step 2 skipped: fp16 gradients overflowed" in capfd.readouterr().err
