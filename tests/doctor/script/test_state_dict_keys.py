"""state_dict_keys: a load_state_dict(strict=False) that filled nothing or little is named with the
prefix that would have matched (in this process, on real modules); a backbone loaded into a model with a
new head is left alone."""

from __future__ import annotations

from torch import nn

from gradsync.doctor.script import registry
from gradsync.doctor.script.state_dict_keys import NAME, KeysWatch
from gradsync.run.check_primitives import Patches
from gradsync.run.harmless import BookkeepingByKind
from gradsync.run.moments import Moments


def _loading(load) -> dict:
    patches = Patches()
    watch = KeysWatch(Moments(), BookkeepingByKind())
    watch.install(patches)
    try:
        load()
    finally:
        patches.undo()
    return {NAME: watch.facts()}


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 2))


def test_a_wrapped_models_keys_loaded_into_the_bare_model_load_nothing():
    saved = {f"module.{key}": value for key, value in _model().state_dict().items()}
    facts = _loading(lambda: _model().load_state_dict(saved, strict=False))
    (finding,) = registry.findings({0: facts, 1: facts}, [NAME])
    assert (finding.category, finding.severity, finding.details["loaded"]) == ("state_dict_loaded_little", "error", 0)
    assert "strip 'module.' from the checkpoint's keys" in finding.message
    bare = _model().state_dict()
    into_wrapper = _loading(lambda: nn.Sequential(_model()).load_state_dict(bare, strict=False))
    (finding,) = registry.findings({0: into_wrapper}, [NAME])
    assert "add '0.' to the checkpoint's keys" in finding.message or finding.details["fix"].startswith("add '0.'")


def test_a_backbone_loaded_into_a_model_with_a_new_head_is_left_alone():
    backbone = {key: value for key, value in _model().state_dict().items() if not key.startswith("2.")}
    facts = _loading(lambda: _model().load_state_dict(backbone, strict=False))
    assert registry.findings({0: facts, 1: facts}, [NAME]) == []
    strict = _loading(lambda: _model().load_state_dict(_model().state_dict()))
    assert strict[NAME]["loads"] == []  # strict loads fail loudly on their own
