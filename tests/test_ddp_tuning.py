"""DDP options the trainer checks for the user: unused parameters named, find_unused_parameters judged."""

import logging

import pytest
import torch

import gradsync
from tests.harness import launch

pytestmark = pytest.mark.launches  # every test here starts processes


class WithSpareHead(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(4, 8)
        self.head = torch.nn.Linear(8, 1)
        self.spare_head = torch.nn.Linear(8, 1)

    def forward(self, x, heads):
        hidden = self.body(x)
        return sum(getattr(self, name)(hidden) for name in heads)


def train_with_spare_head(find_unused, mode):
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("gradsync").addHandler(handler)
    trainer = gradsync.setup(ddp={"find_unused_parameters": find_unused}, metrics={"progress": False})
    model = WithSpareHead()
    data = torch.utils.data.TensorDataset(torch.randn(96, 4), torch.randn(96, 1))
    model, optimizer, loader = trainer.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01), data, batch_size=4)
    error = None
    try:
        for _ in trainer.epochs(1):
            for index, (x, y) in enumerate(loader):
                with trainer.step() as step:
                    heads = {"head": ["head"], "both": ["head", "spare_head"]}.get(mode)
                    if mode == "alternate":
                        heads = ["spare_head"] if index % 3 == 0 else ["head"]
                    step.backward(torch.nn.functional.mse_loss(model(x, heads), y))
    except gradsync.GradsyncError as exc:
        error = f"{type(exc).__name__}: {exc}"
    trainer.close()
    return {"error": error, "messages": messages}


def test_a_parameter_without_gradient_is_named_instead_of_ddps_indices():
    for result in launch(train_with_spare_head, 2, find_unused=False, mode="head"):
        assert result["error"] is not None and result["error"].startswith("ConfigError")
        assert "spare_head.weight, spare_head.bias" in result["error"]
        assert "find_unused_parameters" in result["error"]


@pytest.mark.parametrize("mode, expected", [
    ("both", "every parameter got a gradient in each of the first 10 steps: set it to False"),
    ("alternate", "find_unused_parameters is needed: head.bias, head.weight, spare_head.bias, spare_head.weight"),
])
def test_find_unused_parameters_is_judged_after_the_first_steps(mode, expected):
    rank0 = launch(train_with_spare_head, 2, find_unused=True, mode=mode)[0]
    assert rank0["error"] is None
    assert any(expected in message for message in rank0["messages"]), rank0["messages"]
