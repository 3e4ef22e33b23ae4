"""The doctor's checks, fed the values they judge: environments, interfaces, limits, sizes, ranks."""

from types import SimpleNamespace

import pytest

from gradsync.doctor import checks as C
from gradsync.doctor.checks import (
    Check,
    DeviceAssignment,
    DiskSpace,
    PairResult,
    StoreProbe,
    Versions,
)

MIB, GIB = 1 << 20, 1 << 30


def by_name(checks):
    return {c.name: c for c in checks}


def test_a_non_ok_check_must_carry_a_fix_and_verdicts_are_checked():
    with pytest.raises(ValueError, match="no fix"):
        Check("x", "warning", "v", "m")
    with pytest.raises(ValueError, match="verdict"):
        Check("x", "bad", "v", "m", "f")  # type: ignore[arg-type]
    assert C.worst(["ok", "problem", "warning"]) == "problem" and C.worst(["ok", "warning"]) == "warning"
    assert C.worst([]) == "ok"
    assert C.ranks_text([5, 0, 1, 2, 7, 8]) == "ranks 0-2,5,7-8" and C.ranks_text([3]) == "rank 3"


# --- environment variables -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["NCCL_P2P_DISABLE", "NCCL_IB_DISABLE", "NCCL_SHM_DISABLE"])
def test_nccl_transports_disabled_are_a_performance_warning_with_a_fix(name):
    checks = by_name(C.check_environment({name: "1", "PATH": "/bin"}, cuda=True))
    flagged = checks[name]
    assert flagged.verdict == "warning" and "performance" in flagged.message
    assert f"unset {name}" in flagged.fix
    assert checks["environment"].value == f"{name}=1", "the variables set are listed, others left out"
    assert name not in by_name(C.check_environment({name: "0"}, cuda=True)), "=0 enables the transport: fine"


def test_nccl_debug_info_or_trace_is_a_warning_and_warn_is_not():
    for value in ("INFO", "trace"):
        flagged = by_name(C.check_environment({"NCCL_DEBUG": value}, cuda=True))["NCCL_DEBUG"]
        assert flagged.verdict == "warning" and "NCCL_DEBUG" in flagged.fix
    assert "NCCL_DEBUG" not in by_name(C.check_environment({"NCCL_DEBUG": "WARN"}, cuda=True))


@pytest.mark.parametrize("cuda", [False, True])
def test_torch_distributed_debug_detail_warns_that_it_crashes_ddp_and_points_to_gradsync_run(cuda):
    flagged = by_name(C.check_environment({"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, cuda=cuda))["TORCH_DISTRIBUTED_DEBUG"]
    assert flagged.verdict == "warning"
    assert "known to crash DDP" in flagged.message
    assert "gradsync run" in flagged.fix


def test_other_debug_levels_left_on_are_warnings():
    checks = by_name(C.check_environment({"TORCH_DISTRIBUTED_DEBUG": "INFO", "TORCH_CPP_LOG_LEVEL": "INFO"}, cuda=False))
    assert checks["TORCH_DISTRIBUTED_DEBUG"].verdict == "warning" and "crash" not in checks["TORCH_DISTRIBUTED_DEBUG"].message
    assert checks["TORCH_CPP_LOG_LEVEL"].verdict == "warning" and "WARNING" in checks["TORCH_CPP_LOG_LEVEL"].fix
    quiet = by_name(C.check_environment({"TORCH_DISTRIBUTED_DEBUG": "OFF", "TORCH_CPP_LOG_LEVEL": "ERROR"}, cuda=False))
    assert "TORCH_DISTRIBUTED_DEBUG" not in quiet and "TORCH_CPP_LOG_LEVEL" not in quiet


def test_deprecated_nccl_blocking_wait_names_its_replacement():
    flagged = by_name(C.check_environment({"NCCL_BLOCKING_WAIT": "1"}, cuda=True))["NCCL_BLOCKING_WAIT"]
    assert flagged.verdict == "warning" and "deprecated" in flagged.message
    assert "TORCH_NCCL_BLOCKING_WAIT=1" in flagged.fix


def test_nccl_error_handling_is_judged_on_gpu_hosts_only():
    off = by_name(C.check_environment({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}, cuda=True))["nccl error handling"]
    assert off.verdict == "warning" and "hang" in off.message
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" in off.fix and "TORCH_NCCL_BLOCKING_WAIT" in off.fix
    blocking = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_BLOCKING_WAIT": "1"}
    assert by_name(C.check_environment(blocking, cuda=True))["nccl error handling"].verdict == "ok"
    assert by_name(C.check_environment({}, cuda=True))["nccl error handling"].verdict == "ok"
    cpu = by_name(C.check_environment({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "NCCL_P2P_DISABLE": "1",
                                       "NCCL_DEBUG": "INFO"}, cuda=False))
    assert "nccl error handling" not in cpu and "NCCL_P2P_DISABLE" not in cpu and "NCCL_DEBUG" not in cpu
    assert cpu["nccl settings"].verdict == "ok" and "do not apply" in cpu["nccl settings"].value
    assert "NCCL_P2P_DISABLE" in cpu["nccl settings"].value


def test_the_launchers_own_variables_are_not_listed_as_settings():
    env = {"TORCHELASTIC_RUN_ID": "x", "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0",
           "TORCHELASTIC_ENABLE_FILE_TIMER": "1", "GLOO_SOCKET_IFNAME": "eth0", "HOME": "/root"}
    assert C.relevant_env(env) == {"GLOO_SOCKET_IFNAME": "eth0", "TORCHELASTIC_ENABLE_FILE_TIMER": "1"}
    # torchrun's default for TORCH_NCCL_ASYNC_ERROR_HANDLING is its own; the user's other values are kept.
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in C.relevant_env({**env, "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"})
    assert C.relevant_env({**env, "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"})["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
    assert C.relevant_env({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    assert by_name(C.check_environment({}, cuda=False))["environment"].value == "none set"


# --- network ---------------------------------------------------------------------------------------

IFACES = {"lo": ["127.0.0.1", "::1"], "eth0": ["10.0.0.2", "fe80::1"], "docker0": ["172.17.0.1"], "down0": []}


def gloo(env, address="10.0.0.2", multi_host=False, cuda=False):
    return by_name(C.check_network_interface(env, IFACES, address, multi_host, cuda))


def test_a_gloo_socket_ifname_naming_a_missing_interface_is_a_problem():
    check = gloo({"GLOO_SOCKET_IFNAME": "eth9"})["gloo interface"]
    assert check.verdict == "problem" and "no interface eth9" in check.message
    assert "eth0" in check.fix and "GLOO_SOCKET_IFNAME" in check.fix
    assert gloo({"GLOO_SOCKET_IFNAME": "eth0,eth9"})["gloo interface"].verdict == "problem"
    ok = gloo({"GLOO_SOCKET_IFNAME": "eth0"})["gloo interface"]
    assert ok.verdict == "ok" and "eth0 (10.0.0.2)" in ok.value


def test_gloo_interface_without_address_or_loopback_across_hosts_is_a_problem():
    assert gloo({"GLOO_SOCKET_IFNAME": "down0"})["gloo interface"].verdict == "problem"
    assert gloo({"GLOO_SOCKET_IFNAME": "lo"}, multi_host=True)["gloo interface"].verdict == "problem"
    assert gloo({"GLOO_SOCKET_IFNAME": "lo"}, multi_host=False)["gloo interface"].verdict == "ok"


def test_without_gloo_socket_ifname_the_hostnames_address_picks_the_interface():
    check = gloo({}, address="10.0.0.2")["gloo interface"]
    assert check.verdict == "ok" and check.value.startswith("eth0 (10.0.0.2)")
    loop = gloo({}, address="127.0.1.1")["gloo interface"]
    assert loop.verdict == "ok" and loop.value.startswith("lo (127.0.1.1)")
    assert gloo({}, address="127.0.1.1", multi_host=True)["gloo interface"].verdict == "problem"
    assert gloo({}, address=None)["gloo interface"].verdict == "warning"
    assert gloo({}, address=None, multi_host=True)["gloo interface"].verdict == "problem"
    stray = gloo({}, address="192.168.9.9", multi_host=True)["gloo interface"]
    assert stray.verdict == "problem" and "no interface here holds" in stray.message


def test_nccl_socket_ifname_follows_nccls_prefix_rules_on_gpu_hosts():
    def nccl(setting):
        env = {} if setting is None else {"NCCL_SOCKET_IFNAME": setting}
        return gloo(env, cuda=True)["nccl interface"]

    assert nccl("eth").verdict == "ok" and "eth0" in nccl("eth").value
    assert nccl("^lo,docker").verdict == "ok" and "eth0" in nccl("^lo,docker").value
    assert nccl("=eth").verdict == "problem", "= asks for the exact name"
    assert nccl("ib").verdict == "problem" and "ib" in nccl("ib").message
    assert nccl(None).verdict == "ok" and "eth0" in nccl(None).value and "docker0" not in nccl(None).value
    assert "nccl interface" not in gloo({"NCCL_SOCKET_IFNAME": "ib"}, cuda=False)


def test_hostname_that_does_not_resolve():
    assert C.check_hostname("h", "10.0.0.2", None, False, {}).verdict == "ok"
    assert C.check_hostname("h", "127.0.1.1", None, False, {}).verdict == "ok", "loopback is fine on one host"
    looped = C.check_hostname("h", "127.0.1.1", None, True, {"GLOO_SOCKET_IFNAME": "eth0"})
    assert looped.verdict == "warning" and "--local-addr" in looped.fix
    assert C.check_hostname("h", None, "Name or service not known", False, {}).verdict == "warning"
    bad = C.check_hostname("h", None, "Name or service not known", True, {})
    assert bad.verdict == "problem" and "/etc/hosts" in bad.fix
    assert C.check_hostname("h", None, "x", True, {"GLOO_SOCKET_IFNAME": "eth0"}).verdict == "warning"


def test_an_unreachable_store_names_the_ranks_and_hosts():
    probes = [StoreProbe(0, "a", "10.0.0.1", 29500, True, 0.001), StoreProbe(1, "a", "10.0.0.1", 29500, True, 0.001),
              StoreProbe(2, "b", "10.0.0.1", 29500, False, 3.0, "timed out"),
              StoreProbe(3, "b", "10.0.0.1", 29500, False, 3.0, "timed out")]
    check = C.check_store(probes, launched=True)
    assert check.verdict == "problem" and "ranks 2-3 (b)" in check.message and "10.0.0.1:29500" in check.message
    assert "MASTER_ADDR" in check.fix
    assert C.check_store(probes[:2], launched=True).verdict == "ok"
    assert C.check_store([], launched=False).verdict == "ok"


def pair(a, b, gbps, nbytes=4 * MIB):
    return PairResult(a, b, nbytes, 2 * nbytes / (gbps * 1e9))


def test_a_pair_below_half_the_median_is_named_with_its_hosts():
    hosts = {0: "hA", 1: "hB", 2: "hC", 3: "hD"}
    pairs = [pair(0, 1, 10), pair(0, 2, 10), pair(1, 2, 10), pair(0, 3, 10), pair(1, 3, 10), pair(2, 3, 1)]
    check = C.check_pairs(pairs, hosts)
    assert check.verdict == "warning" and "2<->3 (hC<->hD)" in check.message
    assert "0<->1" not in check.message and "1 slow pair(s) of 6" in check.value
    assert check.fix
    # Rank 3's link is slow: it is in every slow pair, and the report says so.
    slow3 = [pair(0, 1, 10), pair(0, 2, 10), pair(1, 2, 10), pair(0, 3, 1), pair(1, 3, 1), pair(2, 3, 1)]
    check = C.check_pairs(slow3, hosts)
    assert check.verdict == "warning" and "rank 3 (hD) in every slow pair" in check.message


def test_pairs_at_half_the_median_or_alike_are_ok():
    median_half = [pair(0, 1, 10), pair(0, 2, 10), pair(1, 2, 5)]
    assert C.check_pairs(median_half, {}).verdict == "ok", "exactly half the median is not below it"
    assert C.check_pairs([pair(0, 1, 10)], {}).verdict == "ok"
    assert C.check_pairs([], {}, "one rank").value == "not measured (one rank)"
    assert pair(0, 1, 2.5).gbps == pytest.approx(2.5)


def test_all_reduce_is_shown_not_judged():
    result = C.AllReduceResult("gloo", 2, 1024, 50e-6, 16 * MIB, 0.01, 1.68)
    check = C.check_allreduce(result)
    assert check.verdict == "ok" and "1.68 GB/s" in check.value and "50 us at 1 KiB" in check.value
    assert "16 MiB" in check.value and "gloo" in check.message


# --- versions and devices --------------------------------------------------------------------------


def test_different_versions_across_ranks_are_a_problem_naming_ranks_and_hosts():
    same = [Versions(r, "hA" if r < 2 else "hB", "3.11.7", "2.13.0", "12.4", "2.21.5", True) for r in range(3)]
    assert C.check_versions(same).verdict == "ok" and "on all 3 ranks" in C.check_versions(same).value
    mixed = same[:2] + [Versions(2, "hB", "3.11.7", "2.12.1", "12.4", "2.20.3", True)]
    check = C.check_versions(mixed)
    assert check.verdict == "problem"
    assert "torch: 2.13.0 on ranks 0-1 (hA); 2.12.1 on rank 2 (hB)" in check.message
    assert "nccl: 2.21.5 on ranks 0-1 (hA); 2.20.3 on rank 2 (hB)" in check.message
    assert "python" not in check.message and "same" in check.fix
    assert C.check_versions(same[:1]).verdict == "ok"


def test_two_ranks_on_one_gpu_are_a_problem():
    # Two ranks with LOCAL_RANK 0 on one host (two launchers, or a LOCAL_RANK set by hand): one physical GPU.
    shared = [DeviceAssignment(0, "h", 0, 2, "H100", "GPU-aaa"), DeviceAssignment(1, "h", 0, 2, "H100", "GPU-aaa")]
    check = C.check_device_assignment(shared)
    assert check.verdict == "problem" and "ranks 0-1 (h) share one GPU" in check.message
    assert "Duplicate GPU" in check.fix
    renumbered = [DeviceAssignment(0, "h", 0, 1, "H100", "GPU-aaa"), DeviceAssignment(1, "h", 0, 1, "H100", "GPU-bbb")]
    assert C.check_device_assignment(renumbered).verdict == "ok", "CUDA_VISIBLE_DEVICES per rank: different GPUs"
    no_uuid = [DeviceAssignment(0, "h", 0, 2), DeviceAssignment(1, "h", 0, 2), DeviceAssignment(2, "g", 0, 2)]
    check = C.check_device_assignment(no_uuid)
    assert check.verdict == "problem" and "ranks 0-1 (h)" in check.message and "rank 2" not in check.message


def test_a_local_rank_beyond_the_gpu_count_is_a_problem():
    ranks = [DeviceAssignment(r, "h", r, 2, "A100", f"GPU-{r}") for r in range(3)]
    check = C.check_device_assignment(ranks)
    assert check.verdict == "problem" and "rank 2 (h) has LOCAL_RANK 2 but sees only 2 GPU(s)" in check.message
    assert "--nproc-per-node 2" in check.fix
    assert C.check_device_assignment(ranks[:2]).verdict == "ok"
    cpu = [DeviceAssignment(r, "h", r, 0) for r in range(3)]
    assert C.check_device_assignment(cpu).verdict == "ok" and "CPU" in C.check_device_assignment(cpu).value
    mixed = [DeviceAssignment(0, "h", 0, 1, "A100", "GPU-0"), DeviceAssignment(1, "g", 0, 0)]
    assert C.check_device_assignment(mixed).verdict == "problem"


def test_cuda_nccl_gloo_and_topology():
    assert C.check_cuda(None, False, 0).verdict == "ok"
    broken = C.check_cuda("12.4", False, 0)
    assert broken.verdict == "warning" and "nvidia-smi" in broken.fix
    assert C.check_cuda("12.4", True, 8).value == "12.4, 8 GPU(s) usable"
    assert C.check_nccl(False, None, cuda_available=True).verdict == "problem"
    assert C.check_nccl(False, None, cuda_available=False).verdict == "ok"
    assert C.check_gloo(False).verdict == "problem" and C.check_gloo(True).verdict == "ok"
    matrix = "\tGPU0\tGPU1\nGPU0\t X \tNV12\nGPU1\tNV12\t X \n"
    shown = C.check_topology(matrix)
    assert shown.verdict == "ok" and shown.value == matrix.rstrip()
    assert C.check_topology(None).value == "not shown (no nvidia-smi)"
    assert C.check_gpus(["H100", "H100", "A100"], True).value == "2 x H100, 1 x A100"


# --- host limits -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("total", "cuda", "verdict"), [
    (64 * MIB, True, "problem"), (64 * MIB, False, "warning"), (512 * MIB - 1, True, "problem"),
    (512 * MIB, True, "ok"), (8 * GIB, False, "ok"),
])
def test_small_shared_memory(total, cuda, verdict):
    check = C.check_shm("/dev/shm", DiskSpace(total=total, free=total), cuda)
    assert check.verdict == verdict
    if verdict != "ok":
        assert "--shm-size" in check.fix and "512 MiB" in check.message


def test_missing_shared_memory():
    assert C.check_shm("/nope", None, cuda=True).verdict == "problem"
    check = C.check_shm("/nope", None, cuda=False)
    assert check.verdict == "warning" and "mount -t tmpfs" in check.fix


def test_a_low_open_file_limit_is_a_warning_with_the_ulimit_fix():
    check = C.check_open_files(1024, 1048576)
    assert check.verdict == "warning" and "`ulimit -n 65536`" in check.fix
    capped = C.check_open_files(1024, 2048)
    assert capped.verdict == "warning" and "hard limit is 2048" in capped.fix and "--ulimit nofile" in capped.fix
    assert C.check_open_files(4096, 4096).verdict == "ok"
    assert C.check_open_files(-1, -1).verdict == "ok" and "unlimited" in C.check_open_files(-1, -1).value


def fake_statvfs(free_bytes, total_bytes=100 * GIB, frsize=4096):
    return SimpleNamespace(f_frsize=frsize, f_bsize=frsize, f_blocks=total_bytes // frsize, f_bavail=free_bytes // frsize)


@pytest.mark.parametrize(("free", "verdict"), [
    (20 * GIB, "ok"), (10 * GIB, "ok"), (10 * GIB - 4096, "warning"), (5 * GIB, "warning"),
    (GIB - 4096, "problem"), (0, "problem"),
])
def test_low_free_disk_where_checkpoints_go(free, verdict):
    space = DiskSpace.from_statvfs(fake_statvfs(free))
    assert space.free == free and space.total == 100 * GIB
    check = C.check_checkpoint_disk("/ckpt", space, writable=True)
    assert check.verdict == verdict
    if verdict != "ok":
        assert "checkpoint" in check.fix and "bytes per parameter" in check.message


def test_an_unwritable_checkpoint_folder_is_a_problem():
    space = DiskSpace(100 * GIB, 50 * GIB)
    check = C.check_checkpoint_disk("/ckpt/run", space, writable=False, existing="/ckpt")
    assert check.verdict == "problem" and "not writable" in check.message and "to be created in /ckpt" in check.value
    assert C.check_checkpoint_disk("/x", None, writable=False).verdict == "problem"
