"""What the script check's watches share, on real objects: an optimizer's settings as one text."""

from __future__ import annotations

import torch

import copy
import pickle

from torch.nn.modules.module import _global_forward_pre_hooks

from gradsync.run.check_primitives import ModuleForwards, hyperparameters


def test_hyperparameters_cover_every_group_and_see_a_change():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW([{"params": [model.weight]}, {"params": [model.bias], "lr": 0.1}], lr=0.01)
    text = hyperparameters(optimizer)
    assert "lr=0.01" in text and "lr=0.1" in text and "betas=(0.9, 0.999)" in text
    optimizer.param_groups[1]["lr"] = 0.05
    assert hyperparameters(optimizer) != text


def test_module_forwards_calls_the_watched_modules_hooks_and_leaves_nothing_on_them():
    forwards, seen, common = ModuleForwards(), [], len(_global_forward_pre_hooks)
    watched, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    forwards.watch(watched, lambda module, args: seen.append((module, args[0].shape)))
    try:
        watched(torch.ones(3, 2))
        other(torch.ones(1, 2))
        assert seen == [(watched, (3, 2))]
        assert len(watched._forward_pre_hooks) == 0
        twin = copy.deepcopy(watched)
        twin(torch.ones(4, 2))
        pickle.loads(pickle.dumps(watched))(torch.ones(5, 2))
        assert seen == [(watched, (3, 2))]  # copies are the user's own objects
    finally:
        forwards.remove()
    assert len(_global_forward_pre_hooks) == common


def test_module_forwards_stop_for_good_once_the_script_compiles():
    forwards, seen, common = ModuleForwards(), [], len(_global_forward_pre_hooks)
    module = torch.nn.Linear(2, 2)
    forwards.watch(module, lambda *_: seen.append(1))
    forwards.stop()  # torch.compile would warn of a hook common to all modules on each call
    forwards.watch(module, lambda *_: seen.append(2))
    module(torch.ones(1, 2))
    assert seen == [] and len(_global_forward_pre_hooks) == common
