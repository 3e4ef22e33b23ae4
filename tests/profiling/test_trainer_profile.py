"""metrics.profile_steps on the trainer: every rank profiles the window, with the trainer's phases marked."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import gradsync
from gradsync.rundir import RunDir
from gradsync.errors import ConfigError
from tests.harness import launch
from tests.profiling.test_breakdown import _assert_partitions


def _train_profiled(profile_steps):
    trainer = gradsync.setup(accumulation_steps=2, metrics={"log_every": 4, "profile_steps": profile_steps})
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64 * trainer.world_size, 32, generator=g), torch.randn(64 * trainer.world_size, 1, generator=g))
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    model, optimizer, loader = trainer.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01), data, batch_size=4)
    for _ in trainer.epochs(1):
        for x, y in loader:
            with trainer.step() as step:
                step.backward(F.mse_loss(model(x), y))
    trainer.close()
    return json.loads(RunDir(trainer.run_dir).profile_breakdown(trainer.rank).read_text())


@pytest.mark.launches
def test_each_rank_profiles_the_window_with_the_trainers_phases():
    for breakdown in launch(_train_profiled, 2, profile_steps="3:5"):
        assert [s["step"] for s in breakdown["steps"]] == [3, 4, 5]
        assert set(breakdown["annotated_phases"]) == {"data", "forward", "backward", "optimizer"}
        _assert_partitions(breakdown["steps"])
        for step in breakdown["steps"]:
            assert step["forward_s"] > 0 and step["backward_s"] > 0 and step["optimizer_s"] > 0 and step["data_s"] > 0
            assert step["comm_s"] > 0, "one gradient all-reduce per optimizer step (2 micro-steps, no_sync on the first)"


def test_a_bad_window_is_refused_at_setup():
    with pytest.raises(ConfigError, match="profile-steps"):
        gradsync.MetricsConfig(profile_steps="5:3")
