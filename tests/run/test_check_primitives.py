"""What the script check's watches share, on real objects: an optimizer's settings as one text."""

from __future__ import annotations

import torch

from gradsync.run.check_primitives import hyperparameters


def test_hyperparameters_cover_every_group_and_see_a_change():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW([{"params": [model.weight]}, {"params": [model.bias], "lr": 0.1}], lr=0.01)
    text = hyperparameters(optimizer)
    assert "lr=0.01" in text and "lr=0.1" in text and "betas=(0.9, 0.999)" in text
    optimizer.param_groups[1]["lr"] = 0.05
    assert hyperparameters(optimizer) != text
