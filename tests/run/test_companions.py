"""run/companions.py: which modules a training step runs beside the wrapped ones, read from the calls
(in this process, on real modules: the hooks are torch's global ones)."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from gradsync.run.companions import CompanionModules
from gradsync.run.harmless import Bookkeeping


def _line_after() -> str:
    return f"test_companions.py:{inspect.currentframe().f_back.f_lineno + 1}"


class Host:
    """What the script check gives the companions: whether training started, the wrapped modules, the training state."""

    def __init__(self) -> None:
        self.training = False
        self.wrapped: set[int] = set()
        self.state: set[int] = set()
        self.discovered = 0
        self.companions = CompanionModules(lambda: self.training, lambda: self.wrapped, lambda: self.state,
                                           Bookkeeping("test"), self._discovered)

    def _discovered(self) -> None:
        self.discovered += 1


@pytest.fixture
def host():
    made = Host()
    made.companions.install()
    yield made
    made.companions.stop()


def test_a_module_called_beside_the_wrapped_one_is_a_companion_and_its_layers_are_its_own(host):
    model, teacher = nn.Sequential(nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    host.wrapped = {id(m) for m in model.modules()}
    teacher(torch.randn(2, 4))  # before any model is wrapped: not yet training
    assert host.companions.states() == []
    host.training = True
    model(torch.randn(2, 4))
    called = _line_after()
    teacher(torch.randn(2, 4))
    teacher(torch.randn(2, 4))
    (state,) = host.companions.states()
    assert state.key.startswith("Sequential called at ") and state.key.endswith(f"/{called}")
    assert [name for name, _ in state.parameters] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert [name for name, _ in state.buffers] == ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
    assert host.discovered == 1


def test_the_training_state_and_modules_with_nothing_else_are_left_out(host):
    host.training = True
    temperature = nn.Linear(1, 1)  # stepped by the optimizer: the training state's own, compared as such
    host.state = {id(p) for p in temperature.parameters()}
    temperature(torch.randn(2, 1))
    nn.ReLU()(torch.randn(2))
    assert host.companions.states() == []


def test_a_module_built_anew_each_step_replaces_the_one_before(host):
    host.training = True
    for weight in (1.0, 2.0):
        loss = nn.CrossEntropyLoss(weight=torch.tensor([weight, 1.0]))
        loss(torch.randn(3, 2), torch.tensor([0, 1, 0]))
    (state,) = host.companions.states()
    assert state.buffers[0][1][0].item() == 2.0


def test_a_forward_that_raised_is_forgotten_between_steps(host):
    class Raises(nn.Module):
        def forward(self, x):
            raise ValueError("a bad batch")

    host.training = True
    with pytest.raises(ValueError):
        Raises()(torch.randn(1))  # no return hook runs: its call stays open ...
    teacher = nn.Linear(2, 2)
    teacher(torch.randn(1, 2))
    assert host.companions.states() == []  # ... and would own every call after it
    host.companions.between_steps()
    teacher(torch.randn(1, 2))
    assert len(host.companions.states()) == 1
