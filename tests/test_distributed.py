"""The process group: single process without a launcher, torchrun's environment, timeouts."""

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import gradsync
from gradsync import ConfigError, GradsyncError
from gradsync.distributed import (
    backend_devices, choose_backend, collective_device, join_process_group, plan_distributed, read_launcher_env,
    threads_per_worker, usable_cores,
)
from tests.harness import launch


def _describe_process():
    trainer = gradsync.setup(seed=0)
    info = {
        "rank": trainer.rank,
        "world_size": trainer.world_size,
        "device": str(trainer.device),
        "initialized": dist.is_initialized(),
        "backend": dist.get_backend() if dist.is_initialized() else None,
    }
    trainer.close()
    info["destroyed"] = not dist.is_initialized()
    return info


@pytest.mark.launches
def test_plain_process_without_launcher_runs_alone_with_no_process_group():
    (info,) = launch(_describe_process, 1, launcher=False)
    assert info == {
        "rank": 0, "world_size": 1, "device": "cpu", "initialized": False, "backend": None,
        "destroyed": True,
    }


@pytest.mark.launches
def test_launcher_environment_joins_a_gloo_group_on_cpu(world_size):
    infos = launch(_describe_process, world_size)
    assert [i["rank"] for i in infos] == list(range(world_size))
    for info in infos:
        assert info["world_size"] == world_size
        assert info["initialized"] and info["backend"] == "gloo" and info["device"] == "cpu"
        assert info["destroyed"], "close() must leave the process group"


# Also the bound on how far apart the ranks may reach setup's own collectives: under load they
# arrived over 3 s apart, so 10 s (over 20x their quiet skew of well under half a second).
USER_TIMEOUT_S = 10
BARRIER_GAVE_UP = Path("rank0-barrier-gave-up")  # in the launch's folder, which every rank works in


def _late_peer(timeout_s):
    trainer = gradsync.setup(timeout_s=timeout_s)
    if trainer.rank == 1:
        # Never joins the barrier, and stays alive until rank 0's gave up: a peer that left would
        # end the barrier early with "Connection closed by peer".
        while not BARRIER_GAVE_UP.exists():
            time.sleep(0.05)
        return {"waited": None}
    started = time.monotonic()
    try:
        dist.barrier()
    except RuntimeError as exc:
        waited = time.monotonic() - started
        BARRIER_GAVE_UP.touch()
        return {"waited": waited, "error": str(exc)[:200]}
    BARRIER_GAVE_UP.touch()
    return {"waited": None, "error": "barrier returned without the peer"}


@pytest.mark.launches
def test_timeout_is_the_users_not_the_backends_thirty_minutes():
    rank0, _ = launch(_late_peer, 2, timeout_s=USER_TIMEOUT_S)
    assert rank0["waited"] is not None, rank0
    # Gloo names the timeout it applied; it cannot give up before it, and far more than 5x
    # later would not be the user's timeout (Gloo's own is 30 minutes).
    assert f"Timed out waiting {USER_TIMEOUT_S * 1000}ms" in rank0["error"], rank0
    assert 0.8 * USER_TIMEOUT_S < rank0["waited"] < 5 * USER_TIMEOUT_S, rank0


def test_incomplete_launcher_environment_is_a_clear_error():
    with pytest.raises(GradsyncError, match="MASTER_ADDR, MASTER_PORT not set"):
        read_launcher_env({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    with pytest.raises(GradsyncError, match="RANK must be in"):
        read_launcher_env({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "x", "MASTER_PORT": "1"})
    assert read_launcher_env({}) is None


def test_backend_follows_the_device():
    assert choose_backend(None, torch.device("cpu")) == "gloo"
    with pytest.raises(ConfigError, match="only moves CUDA tensors"):
        choose_backend("nccl", torch.device("cpu"))
    plan = plan_distributed(
        None, None,
        {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
    )
    assert (plan.rank, plan.world_size, plan.backend) == (1, 2, "gloo" if not torch.cuda.is_available() else "nccl")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_cuda_requested_without_a_gpu_is_a_clear_error():
    with pytest.raises(ConfigError, match="no usable CUDA device"):
        plan_distributed("cuda", None, {})


def test_backend_devices_say_whether_a_group_takes_cpu_tensors():
    assert backend_devices("nccl") == ["cuda"], "pure NCCL refuses CPU tensors"
    assert "cpu" in backend_devices("gloo")
    assert backend_devices("cuda:nccl") == ["cuda"]
    assert backend_devices("cpu:gloo,cuda:nccl") == ["cpu", "cuda"]
    assert backend_devices("undefined") == ["cpu"], "torch's default map backs an undefined group with Gloo on the CPU"


def _adopt_cuda_only_group():
    # A Gloo group registered for CUDA tensors only refuses CPU tensors as a pure NCCL group
    # does, which lets a CPU machine stand in for one.
    dist.init_process_group("cuda:gloo", init_method="env://")
    ctx = join_process_group(plan_distributed(None, None), timeout_s=None)
    flag = torch.ones(1)
    dist.all_reduce(flag, group=ctx.control_group)
    result = {
        "backend": ctx.backend,
        "world": collective_device().type,
        "control_backend": str(dist.get_backend(ctx.control_group)),
        "control": collective_device(ctx.control_group).type,
        "sum": flag.item(),
    }
    try:
        dist.all_reduce(torch.ones(1))
    except RuntimeError as error:
        result["cpu_on_world"] = str(error)
    dist.destroy_process_group()
    return result


@pytest.mark.launches
def test_a_group_without_cpu_backend_gets_a_gloo_control_group_for_small_tensors():
    results = launch(_adopt_cuda_only_group, 2)
    for result in results:
        assert result["backend"] == "cuda:gloo"
        assert result["world"] == "cuda", "small tensors on such a group go to the current CUDA device"
        assert (result["control_backend"], result["control"], result["sum"]) == ("gloo", "cpu", 2.0)
        assert "No backend type associated with device type cpu" in result["cpu_on_world"]


def test_workers_share_the_cores_this_process_may_use_not_the_machines(monkeypatch):
    """Slurm's --cpus-per-task=8 on a 128-core node: 8 workers get one thread each, not 16."""
    monkeypatch.setattr(os, "cpu_count", lambda: 128)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert usable_cores() == 8
    assert [threads_per_worker(w) for w in (1, 2, 8, 16)] == [8, 4, 1, 1]
