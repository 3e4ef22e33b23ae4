"""What a rank collects: limits, filesystems, interfaces, the hostname and the store, read with
injectable system calls so a test can fake a value the machine does not have."""

import resource
import socket
from types import SimpleNamespace

import pytest
import torch

from gradsync.doctor import checks as C
from gradsync.doctor import facts as F
from gradsync import netif


def test_disk_space_reads_statvfs_and_a_failing_one_gives_none(tmp_path):
    fake = SimpleNamespace(f_frsize=4096, f_bsize=4096, f_blocks=1000, f_bavail=250)
    assert F.disk_space(tmp_path, statvfs=lambda path: fake) == C.DiskSpace(total=4096 * 1000, free=4096 * 250)

    def broken(path):
        raise FileNotFoundError(path)

    assert F.disk_space(tmp_path, statvfs=broken) is None
    real = F.disk_space(tmp_path)
    assert real is not None and 0 < real.free <= real.total


def test_the_open_file_limit_comes_from_getrlimit_with_unlimited_as_minus_one():
    asked = []

    def getrlimit(which):
        asked.append(which)
        return 1024, resource.RLIM_INFINITY

    assert F.nofile_limit(getrlimit) == (1024, -1)
    assert asked == [resource.RLIMIT_NOFILE]
    assert C.check_open_files(*F.nofile_limit(getrlimit)).verdict == "warning"
    soft, hard = F.nofile_limit()
    assert (soft, hard) == tuple(-1 if v == resource.RLIM_INFINITY else v for v in resource.getrlimit(resource.RLIMIT_NOFILE))


def test_a_checkpoint_folder_not_yet_there_is_judged_where_it_would_be_created(tmp_path):
    assert F.existing_folder(tmp_path / "a" / "b") == tmp_path
    assert F.existing_folder(tmp_path) == tmp_path
    host = F.host_facts(str(tmp_path / "a" / "b"), "/dev/shm", with_topology=False)
    assert host.checkpoint_existing == str(tmp_path) and host.checkpoint_writable
    assert host.checkpoint_dir == str(tmp_path / "a" / "b")


@pytest.mark.launches
def test_a_small_tmpfs_as_shared_memory_and_checkpoint_disk(small_tmpfs):
    host = F.host_facts(str(small_tmpfs), str(small_tmpfs), with_topology=False)
    assert host.shm is not None and host.shm.total == 64 << 20
    assert C.check_shm(host.shm_path, host.shm, cuda=False).verdict == "warning"
    assert C.check_shm(host.shm_path, host.shm, cuda=True).verdict == "problem"
    check = C.check_checkpoint_disk(host.checkpoint_dir, host.checkpoint, host.checkpoint_writable)
    assert check.verdict == "problem" and "64 MiB free" in check.value


def test_interfaces_with_psutil_and_with_the_stdlib_agree_on_loopback():
    for listing in (netif.network_interfaces(), netif._stdlib_interfaces()):
        assert "127.0.0.1" in listing["lo"]
        assert set(listing) == {name for _, name in socket.if_nameindex()}


def test_hostname_resolution():
    assert F.resolve_hostname("localhost")[0] == "127.0.0.1"
    address, error = F.resolve_hostname("no-such-host.invalid")
    assert address is None and error


def test_store_probe_connects_or_says_why_not():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        probe = F.probe_store(1, "h", "127.0.0.1", port)
        assert probe.reachable and probe.error is None and probe.port == port
    closed = F.probe_store(1, "h", "127.0.0.1", port, timeout_s=1.0)
    assert not closed.reachable and closed.error
    waited = F.probe_store(1, "h", "127.0.0.1", port, timeout_s=1.0, wait_s=0.6)
    assert not waited.reachable and waited.seconds >= 0.6, "a store that may not be up yet is retried"


def test_rank_facts_on_this_machine(tmp_path):
    env = {"NCCL_DEBUG": "INFO", "TORCHELASTIC_RUN_ID": "x", "HOME": "/root", "GROUP_RANK": "3"}
    facts = F.rank_facts(1, 1, env, str(tmp_path), "/dev/shm")
    assert facts.env == {"NCCL_DEBUG": "INFO"} and facts.node == "3" and (facts.rank, facts.local_rank) == (1, 1)
    assert facts.hostname == socket.gethostname() and facts.gloo_available
    assert facts.host.topology is None and facts.host.topology_reason == "shown by local rank 0"
    assert len(facts.gpu_names) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert facts.torch == torch.__version__ and facts.cuda == torch.version.cuda


def test_store_probe_waits_for_a_store_that_comes_up_late(monkeypatch):
    # The store comes up during the probe's first pause after a refused connection: ordered by the
    # probe's own steps, not by a timer racing it (a probe started late would never be refused).
    import time

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        port = server.getsockname()[1]
        pauses = []

        def pause(seconds):
            pauses.append(seconds)
            if len(pauses) == 1:
                server.listen()
            time.sleep(seconds)

        monkeypatch.setattr(F, "time", SimpleNamespace(monotonic=time.monotonic, sleep=pause))
        probe = F.probe_store(1, "h", "127.0.0.1", port, timeout_s=1.0, wait_s=10)
    assert probe.reachable and probe.error is None, probe
    assert len(pauses) == 1, "refused once, then connected on the next try"
    assert probe.seconds >= pauses[0], "the time it waited is in its report"
