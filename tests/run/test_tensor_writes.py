"""Writes to the training state read at the tensor level (gradsync.run.tensor_writes): whatever path
made them, named by the user's line, and nothing else heard."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from gradsync.run.check_primitives import Patches, tensors_fingerprint
from gradsync.run.harmless import Bookkeeping
from gradsync.run.tensor_writes import StateIndex, TensorWrites


def _line(tag: str) -> str:
    number = next(i for i, text in enumerate(open(__file__), 1) if text.rstrip().endswith(f"# line: {tag}"))
    return f"tests/run/test_tensor_writes.py:{number}"


@pytest.fixture
def watched():
    """A model whose parameters, gradients and buffers are the state; the writes heard; a flag
    for the optimizer's step under way."""
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    model(torch.ones(4, 3)).sum().backward()
    heard, stepping, loop = [], [False], [None]
    writes = TensorWrites(heard.append, Bookkeeping("the test's state-write watch"), lambda: stepping[0], lambda: False,
                          lambda: loop[0])
    patches = Patches()
    writes.install(patches)

    def index() -> None:
        writes.index.rebuild([("parameter", n, p) for n, p in model.named_parameters()]
                             + [("gradient", n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
                             + [("buffer", n, b) for n, b in model.named_buffers()])

    index()
    try:
        yield model, heard, stepping, writes, index, loop
    finally:
        patches.undo()


def test_every_path_that_writes_a_parameter_is_heard_with_its_line(watched):
    model, heard, *_ = watched
    weight = model[0].weight
    with torch.no_grad():
        weight.mul_(0.5)  # line: in place
        weight.data.add_(1.0)  # line: through data
        weight[0, 0] = 3.0  # line: setitem
        nn.init.uniform_(model[0].bias, -0.1, 0.1)  # line: init
        torch.add(weight, 1, out=weight)  # line: out
    weight.data = torch.zeros(2, 3)  # line: data set
    assert [(w.op, w.kinds, w.names, w.site) for w in heard] == [
        ("mul_", ("parameter",), ("0.weight",), _line("in place")),
        ("add_", ("parameter",), ("0.weight",), _line("through data")),
        ("__setitem__", ("parameter",), ("0.weight",), _line("setitem")),
        ("uniform_", ("parameter",), ("0.bias",), _line("init")),
        ("add", ("parameter",), ("0.weight",), _line("out")),
        ("data =", ("parameter",), ("0.weight",), _line("data set")),
    ]
    assert heard[0].scalars == ("0.5",) and heard[1].scalars == ("1.0",)


def test_gradients_flags_and_buffers_are_heard_as_what_they_are(watched):
    model, heard, *_ = watched
    for p in model[0].parameters():
        p.grad.div_(4)  # line: grad
    model[0].weight.requires_grad_(False)  # line: freeze
    model[0].bias.grad = None  # line: grad set
    model[1].running_mean.fill_(0.0)  # line: buffer
    assert [(w.op, w.kinds, w.site, w.scalars) for w in heard] == [
        ("div_", ("gradient",), _line("grad"), ("4",)),
        ("div_", ("gradient",), _line("grad"), ("4",)),
        ("requires_grad_", ("parameter",), _line("freeze"), ("False",)),
        ("grad =", ("gradient",), _line("grad set"), ()),
        ("fill_", ("buffer",), _line("buffer"), ("0.0",)),
    ]


def test_writes_inside_the_optimizers_step_and_to_other_tensors_are_not_heard(watched):
    model, heard, stepping, *_ = watched
    other = torch.ones(3)
    other.mul_(2)
    copy.deepcopy(model[0].weight).data.mul_(2)  # a copy's memory is its own
    model[0].weight.detach().clone().add_(1)
    stepping[0] = True
    with torch.no_grad():
        model[0].weight.sub_(0.1)  # the update itself
    assert heard == []


def test_a_view_of_a_parameter_is_the_parameter():
    index = StateIndex()
    weight, gradient = torch.zeros(4, 4), torch.zeros(8)
    index.rebuild([("parameter", "w", weight), ("gradient", "w", gradient)])
    assert index.of(weight[2:]) == [("parameter", "w", False)]
    assert index.of(gradient.view(2, 4)[1]) == [("gradient", "w", False)]
    assert index.of(torch.zeros(4)) == []


def test_the_mode_comes_off_for_good_when_the_script_compiles(watched):
    model, heard, _, writes, *_ = watched
    writes.stop()  # what the host does at torch.compile
    assert writes.mode not in torch.overrides._get_current_function_mode_stack()
    model[0].weight.data.mul_(2)
    assert heard == []


def _update(teacher: nn.Module) -> None:
    with torch.no_grad():
        teacher.weight.mul_(0.5)  # line: companion write


def test_a_companions_write_says_what_it_left_and_the_loop_line_it_was_made_under(watched):
    model, heard, _, writes, _, loop = watched
    teacher = nn.Linear(3, 2)
    writes.index.rebuild([("companion", "Teacher called at train.py:9: weight", teacher.weight),
                          ("parameter", "0.weight", model[0].weight)])
    loop[0] = test_a_companions_write_says_what_it_left_and_the_loop_line_it_was_made_under.__code__
    _update(teacher)  # line: under the loop
    with torch.no_grad():
        model[0].weight.mul_(2.0)  # line: parameter
    companion, parameter = heard
    assert (companion.kinds, companion.site, companion.loop_site) == (("companion",), _line("companion write"), _line("under the loop"))
    assert companion.result == tensors_fingerprint([teacher.weight])
    assert (parameter.loop_site, parameter.result) == (_line("parameter"), None)  # what it left is read for companions only


def test_a_followed_tensor_is_followed_into_what_is_computed_from_it_and_forgotten_when_it_dies():
    from gradsync.run.tensor_writes import Derivations

    writes = TensorWrites(lambda write: None, Bookkeeping("the test's state-write watch"), lambda: False, lambda: False,
                          lambda: None)
    patches = Patches()
    writes.install(patches)
    try:
        copy_of_own = torch.zeros(2, 2)
        other = torch.ones(2, 2, requires_grad=True)
        writes.follow(copy_of_own, "train.py:40")
        stacked = torch.cat([other, copy_of_own])  # a list holding it
        loss = (other @ stacked.T).sum()
        unrelated = (other * 3).sum()
        assert writes.origin(loss) == "train.py:40" and writes.origin(stacked) == "train.py:40"
        assert writes.origin(unrelated) is None and writes.origin(other) is None
        del copy_of_own, stacked, loss
        assert not writes.mode.derivations  # every followed tensor died: nothing left to look for
    finally:
        patches.undo()
    assert writes.origin(torch.zeros(1)) is None
    bounded = Derivations()
    kept = [torch.zeros(1) for _ in range(Derivations.FOLLOWED_AT_MOST + 1)]
    for tensor in kept:
        bounded.follow(tensor, "x")
    assert bounded.origin(kept[0]) == "x" and bounded.origin(kept[-1]) is None
