"""The private torch APIs gradsync relies on: the list stays true, and a torch without one gets a clear line."""

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gradsync import compat
from gradsync.errors import ConfigError
from gradsync.run.collectives import CollectiveRecorder, install
from tests.harness import launch

ALL_FACES = (compat.RUN, compat.DOCTOR_STEPS, compat.PROFILE_STEPS, compat.RESTARTS, compat.TRAINER)


class StandIn:
    """A torch class of some future release: it kept `kept` and dropped the rest."""

    def kept(self):
        return "kept"

    def __init__(self, set_in_init: bool = True):
        if set_in_init:
            self.state = 1


_OWNER = f"{__name__}:StandIn"


def _api(name: str, face: str = "gradsync run", **kwargs) -> compat.PrivateApi:
    return compat.PrivateApi(_OWNER, name, face, use=kwargs.pop("use", f"gradsync wraps {name}"),
                             without=kwargs.pop("without", f"{name} is lost"), **kwargs)


def test_every_listed_attribute_exists_on_the_tested_torch():
    assert torch.__version__.split("+")[0] == compat.TESTED_TORCH
    assert [api.where for api in compat.PRIVATE_APIS if not api.on_instance and not api.available()] == []
    assert compat.check(*ALL_FACES) == []
    assert compat.check_run(doctor_steps=True, profile_steps=True, restarts=True) == []


def _ddp_instance_lacks() -> list[str]:
    dist.init_process_group("gloo")
    model = DistributedDataParallel(torch.nn.Linear(2, 2))
    lacking = [api.where for api in compat.DDP_INSTANCE if not api.available(model)]
    # No destroy_process_group(): with the DDP model still alive it would hold the group's last
    # reference and deadlock in its destructor (see tests/comm/test_compression.py).
    return lacking


@pytest.mark.launches
def test_every_listed_ddp_instance_attribute_exists_on_the_tested_torch():
    assert launch(_ddp_instance_lacks, 1) == [[]]


def test_a_lost_feature_is_one_line_naming_the_torch_version_and_what_is_lost(monkeypatch):
    monkeypatch.setattr(compat, "PRIVATE_APIS", (_api("kept"), _api("_gone", use="gradsync run wraps to record X")))
    assert compat.missing("gradsync run") == [compat.PRIVATE_APIS[1]]
    assert compat.check("gradsync run") == [
        f"torch {torch.__version__} has no StandIn._gone, which gradsync run wraps to record X: _gone is lost "
        f"(gradsync is tested with torch {compat.TESTED_TORCH})"
    ]
    assert compat.check("another face") == []


def test_apis_that_cost_the_same_share_one_line(monkeypatch):
    monkeypatch.setattr(compat, "PRIVATE_APIS", (_api("_a", without="restarts go undiagnosed"), _api("_b", without="restarts go undiagnosed")))
    assert compat.check("gradsync run") == [
        f"torch {torch.__version__} has none of StandIn._a, StandIn._b, which gradsync run relies on: restarts go "
        f"undiagnosed (gradsync is tested with torch {compat.TESTED_TORCH})"
    ]


def test_nothing_lost_says_nothing(monkeypatch):
    monkeypatch.setattr(compat, "PRIVATE_APIS", (_api("_gone", without=None),))
    assert compat.check("gradsync run") == []


def test_a_feature_that_cannot_run_is_refused_with_what_to_do(monkeypatch):
    monkeypatch.setattr(compat, "PRIVATE_APIS", (
        _api("_gone", face=compat.PROFILE_STEPS, required=True, without="profile with the trainer instead"),
        _api("_also_gone", face=compat.RUN),
    ))
    assert len(compat.check_run(doctor_steps=True, profile_steps=False, restarts=True)) == 1, "a run without the option goes on"
    with pytest.raises(ConfigError) as refused:
        compat.check_run(doctor_steps=False, profile_steps=True, restarts=False)
    assert str(refused.value) == (
        f"torch {torch.__version__} has no StandIn._gone, which gradsync wraps _gone: profile with the trainer instead."
    )


def test_a_missing_module_or_class_is_a_missing_attribute_not_an_import_error():
    assert not compat.PrivateApi("gradsync_no_such_module:Thing", "_x", "f", "u", "w").available()
    assert not compat.PrivateApi(f"{__name__}:NoSuchClass", "_x", "f", "u", "w").available()
    assert compat.PrivateApi(_OWNER, "kept", "f", "u", "w").get() is StandIn.kept


def test_an_instance_without_what_init_used_to_set_is_told_with_what_it_costs():
    apis = (_api("state", on_instance=True, without="the state is guessed"),)
    assert compat.lacking_on(StandIn(), apis) is None
    assert compat.lacking_on(StandIn(set_in_init=False), apis).endswith("without StandIn.state, the state is guessed")


def _watch_a_ddp_model_lacking_private_attributes():
    from gradsync.run.collectives import DDPWatch

    dist.init_process_group("gloo")
    try:
        model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1)))
        for api in compat.DDP_INSTANCE:
            delattr(model, api.name)
        watch = DDPWatch(model)
        return {"order": watch.reducer_order, "signature": watch.gradient_signature, "group": watch.process_group,
                "note": compat.lacking_on(model, compat.DDP_INSTANCE)}
    finally:
        dist.destroy_process_group()


@pytest.mark.launches
def test_the_recorder_degrades_on_a_ddp_model_lacking_private_attributes():
    (result,) = launch(_watch_a_ddp_model_lacking_private_attributes, 1)
    assert result["order"] == ["0.weight", "0.bias", "1.weight", "1.bias"], "the module's parameters stand in"
    assert (result["signature"], result["group"]) == ("float32[19]", None)
    assert "DistributedDataParallel._module_parameters" in result["note"]


def test_the_recorder_leaves_out_a_ddp_step_this_torch_lacks(monkeypatch):
    original = DistributedDataParallel._match_all_reduce_for_bwd_pass
    gone = compat.PrivateApi(
        "torch.nn.parallel:DistributedDataParallel", "_match_all_reduce_renamed_in_a_later_torch", compat.RUN, "u", "w"
    )
    monkeypatch.setattr(compat, "DDP_JOIN_SHADOW", gone)
    uninstall = install(CollectiveRecorder())
    try:
        assert DistributedDataParallel._match_all_reduce_for_bwd_pass is original
        assert DistributedDataParallel._sync_module_buffers.__wrapped__ is not None, "the others are still recorded"
    finally:
        uninstall()
    assert not hasattr(DistributedDataParallel, gone.name)
