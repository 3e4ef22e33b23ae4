"""The simulated cluster: namespaces that are isolated, connected, shaped, usable by torchrun, and
always removed. Everything but the spec checks needs root and network namespaces (skipped
otherwise with the reason `available()` gives)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gradsync.bench import cluster as cl
from gradsync.bench.cluster import (
    ClusterError,
    ClusterSpec,
    SimulatedCluster,
    list_namespaces,
)
from gradsync.distributed import threads_per_worker
from gradsync.errors import ConfigError

PY = sys.executable


# --- master ports ------------------------------------------------------------------------------


def test_master_ports_lie_below_the_ephemeral_range():
    """A benchmark hands each job the next master port from FIRST_MASTER_PORT: a thousand jobs
    must stay clear of the ports outgoing connections are given, or a job's store can find its
    port taken by the last job's connections."""
    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")
    if not ranges.exists():
        pytest.skip("no /proc/sys/net/ipv4/ip_local_port_range (not Linux)")
    low, _ = map(int, ranges.read_text().split())
    assert cl.FIRST_MASTER_PORT + 1000 < low


# --- spec validation (no root needed) -----------------------------------------------------------


@pytest.mark.parametrize("link", ["fast", "300", "300 mbit", "mbit", "-1gbit", "1gb", "0mbit", ""])
def test_spec_rejects_a_bad_rate(link):
    with pytest.raises(ConfigError, match="link="):
        ClusterSpec(link=link)


@pytest.mark.parametrize("hosts", [0, 1, -2, 2.0, True, 255])
def test_spec_rejects_a_bad_host_count(hosts):
    with pytest.raises(ConfigError, match="hosts="):
        ClusterSpec(hosts=hosts)


def test_spec_rejects_bad_delay_and_loss():
    with pytest.raises(ConfigError, match="delay="):
        ClusterSpec(delay="1 lightyear")
    with pytest.raises(ConfigError, match="loss="):
        ClusterSpec(loss=101)


def test_spec_accepts_tc_rates():
    assert ClusterSpec(link="300mbit").link_bits_per_second == 300e6
    assert ClusterSpec(link="10Gbit").link_bits_per_second == 10e9
    assert ClusterSpec(link="1.5kbit").link_bits_per_second == 1500
    assert ClusterSpec(link="1mbps").link_bits_per_second == 8e6  # tc: bps is bytes per second
    assert ClusterSpec(link="1mibit").link_bits_per_second == 2**20
    assert not ClusterSpec().needs_netem and ClusterSpec(delay="1ms").needs_netem


# --- helpers run inside the namespaces ----------------------------------------------------------

# Host that listens: prints "ready", then either echoes one message or receives `size` bytes and
# prints the rate it measured from accepting the connection to the last byte.
SERVER = textwrap.dedent(
    """
    import json, socket, sys, time
    address, port, mode, size = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    server = socket.create_server((address, port))
    print("ready", flush=True)
    conn, _ = server.accept()
    start = time.perf_counter()
    if mode == "echo":
        conn.sendall(conn.recv(1024))
    else:
        got = 0
        while got < size:
            chunk = conn.recv(1 << 20)
            if not chunk:
                break
            got += len(chunk)
        elapsed = time.perf_counter() - start
        conn.sendall(b"k")
        print(json.dumps({"bytes": got, "seconds": elapsed}), flush=True)
    conn.close()
    """
)

CLIENT = textwrap.dedent(
    """
    import socket, sys
    address, port, mode, size = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    conn = socket.create_connection((address, port), timeout=20)
    if mode == "echo":
        conn.sendall(b"ping")
        print(conn.recv(1024).decode(), flush=True)
    else:
        conn.sendall(b"x" * size)
        assert conn.recv(1) == b"k"
    """
)


def _serve_and_connect(cluster: SimulatedCluster, mode: str, size: int = 0) -> tuple[str, str]:
    """Server on the last host, client on host 0; returns (server output, client output)."""
    server_host = cluster.hosts[-1]
    args = [server_host.address, "4711", mode, str(size)]
    server = cluster.run(len(cluster.hosts) - 1, [PY, "-c", SERVER, *args], stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "ready"
    proc = cluster.run(0, [PY, "-c", CLIENT, *args], stdout=subprocess.PIPE, text=True)
    client_out, _ = proc.communicate(timeout=60)
    server_out, _ = server.communicate(timeout=60)
    assert proc.returncode == 0 and server.returncode == 0
    return server_out, client_out


def _wait(predicate, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _addresses(cluster: SimulatedCluster, index: int) -> set[tuple[str, str, str]]:
    """(interface, family, address) of every address host `index` sees."""
    proc = cluster.run(index, ["ip", "-o", "addr"], stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=20)
    return {tuple(line.split()[1:4]) for line in out.splitlines() if line.strip()}


# --- a real cluster ----------------------------------------------------------------------------


@pytest.mark.launches
@pytest.mark.timeout(60)
@pytest.mark.parametrize("hosts", [2, 3])
def test_hosts_are_isolated_connected_and_removed(needs_cluster, hosts):
    with SimulatedCluster(ClusterSpec(hosts=hosts, link="1gbit")) as cluster:
        prefix = cluster.prefix
        assert len(list_namespaces(prefix)) == hosts + (1 if hosts > 2 else 0)  # + the switch
        assert len({h.address for h in cluster.hosts}) == hosts
        for i, host in enumerate(cluster.hosts):
            seen = _addresses(cluster, i)
            # Only lo and its own link; exactly one IPv4 address on it (no IPv6 for Gloo to pick).
            assert {interface for interface, _, _ in seen} == {"lo", host.interface}
            assert {(name, a) for name, family, a in seen if family == "inet"} == {
                ("lo", "127.0.0.1/8"),
                (host.interface, f"{host.address}/24"),
            }
            assert [a for name, family, a in seen if name == host.interface and family == "inet6"] == []
        _, echoed = _serve_and_connect(cluster, "echo")
        assert echoed.strip() == "ping"
        sleeper = cluster.run(1, [PY, "-c", "import time; time.sleep(60)", "sleeper-on-host-1"])
        try:
            assert _wait(lambda: any("sleeper-on-host-1" in line for line in cluster.command_lines(1)))
            assert not any("sleeper-on-host-1" in line for line in cluster.command_lines(0))
        finally:
            sleeper.kill()
            sleeper.wait()
        assert not any("sleeper-on-host-1" in line for line in cluster.command_lines(1))
    assert list_namespaces(prefix) == []
    cluster.close()  # idempotent


@pytest.mark.launches
@pytest.mark.timeout(60)
def test_link_is_shaped(needs_cluster):
    size = 3_000_000
    with SimulatedCluster(ClusterSpec(hosts=2, link="50mbit")) as cluster:
        shaping = [subprocess.run(["tc", "-n", host.name, "qdisc", "show", "dev", host.interface],
                                  capture_output=True, text=True, check=True).stdout for host in cluster.hosts]
        server_out, _ = _serve_and_connect(cluster, "rate", size)
    assert all("tbf" in qdisc and "rate 50Mbit" in qdisc for qdisc in shaping), shaping
    measured = json.loads(server_out.strip().splitlines()[-1])
    assert measured["bytes"] == size
    mbit_s = measured["bytes"] * 8 / measured["seconds"] / 1e6
    print(f"50mbit link: measured {mbit_s:.1f} Mbit/s")
    # Unshaped veth moves several Gbit/s here: under the rate (plus its small burst) the limit
    # applies. A busy machine only slows the transfer, so no lower bound: that the rate is 50
    # Mbit/s and not less is what tc says it was given, above.
    assert mbit_s < 70, f"measured {mbit_s:.1f} Mbit/s on a 50mbit link"


TORCH_SCRIPT = """
import os, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(4)
dist.all_reduce(t)
with open(os.path.join({out!r}, f"rank{{rank}}.txt"), "w") as f:
    f.write(repr(t.tolist()))
    f.flush()
    os.fsync(f.fileno())
dist.barrier()
sys.stdout.flush()
sys.stderr.flush()
# Not destroy_process_group(): a rank tearing down while its peer still does can SIGABRT.
os._exit(0)
"""


@pytest.mark.launches
@pytest.mark.timeout(180)
def test_torchrun_gloo_all_reduce_across_hosts(needs_cluster, tmp_path, monkeypatch, capsys):
    script = tmp_path / "allreduce.py"
    script.write_text(TORCH_SCRIPT.format(out=str(tmp_path)))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    code = cl.main(
        [
            "--hosts", "2", "--link", "300mbit", "--master-port", "29531", "--",
            PY, "-m", "torch.distributed.run",
            "--nnodes", "{nnodes}", "--node-rank", "{node_rank}",
            "--master-addr", "{master_addr}", "--master-port", "{master_port}",
            "--nproc-per-node", "1", str(script),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}.txt").read_text() == repr([2.0] * 4)
    assert list_namespaces() == []


@pytest.mark.launches
@pytest.mark.timeout(120)
def test_each_hosts_workers_get_their_share_of_the_machines_cores_unless_told(needs_cluster, tmp_path, monkeypatch):
    (tmp_path / "threads_probe.py").write_text(
        "import os, pathlib\n"
        f"pathlib.Path({str(tmp_path)!r}, 'rank' + os.environ['RANK']).write_text(os.environ['OMP_NUM_THREADS'])\n"
    )
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    share = str(threads_per_worker(2))
    with cl.SimulatedCluster(cl.ClusterSpec(hosts=2, link="1gbit")) as cluster:
        assert cl.run_torchrun(cluster, 1, ["threads_probe"], 29533, environment={"PYTHONPATH": str(tmp_path)}) == 0
        assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == [share, share]
        assert cl.run_torchrun(cluster, 1, ["threads_probe"], 29534,
                               environment={"PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "3"}) == 0
        assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["3", "3"]


@pytest.mark.launches
@pytest.mark.timeout(60)
def test_a_failing_host_fails_the_run_and_everything_is_removed(needs_cluster, capsys):
    started = time.monotonic()
    code = cl.main(
        [
            "--hosts", "2", "--link", "1gbit", "--grace", "1", "--",
            PY, "-c",
            (
                "import sys, time; print('rank {node_rank} of {nnodes} at {address}', flush=True); "
                "sys.exit(1) if {node_rank} == 1 else time.sleep(60)"
            ),
        ]
    )
    out = capsys.readouterr()
    assert code != 0
    assert time.monotonic() - started < 30, "the surviving host was not stopped"
    assert "[host 1] rank 1 of 2 at 10.213." in out.out
    assert "[host 0] rank 0 of 2 at 10.213." in out.out
    assert "host 1 exited with 1" in out.err
    assert list_namespaces() == []


@pytest.mark.launches
@pytest.mark.timeout(60)
def test_a_half_built_cluster_is_removed(needs_cluster, monkeypatch):
    def broken_shape(self, namespace, interface):
        raise ClusterError("simulated failure while shaping")

    monkeypatch.setattr(SimulatedCluster, "_shape", broken_shape)
    cluster = SimulatedCluster(ClusterSpec(hosts=3))
    with pytest.raises(ClusterError, match="simulated failure"):
        cluster.open()
    assert list_namespaces(cluster.prefix) == []


CHILD = """
import faulthandler, signal, sys, time
faulthandler.register(signal.SIGUSR1)  # the test asks for the stack if the child does not end
# Python's own SIGINT, as under a terminal: a shell that starts pytest in the background makes
# its children ignore SIGINT, and gradsync rightly leaves an ignored signal ignored.
signal.signal(signal.SIGINT, signal.default_int_handler)
from gradsync.bench.cluster import ClusterSpec, SimulatedCluster
cluster = SimulatedCluster(ClusterSpec(hosts=2)).open()
worker = cluster.run(0, [sys.executable, "-c", "import time; time.sleep(60)"])
print(cluster.prefix, flush=True)
time.sleep(60)
"""


@pytest.mark.launches
@pytest.mark.timeout(60)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_removes_the_cluster(needs_cluster, signum):
    child = subprocess.Popen([PY, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        prefix = child.stdout.readline().strip()
        assert prefix.startswith("gs"), child.stderr.read()
        assert list_namespaces(prefix)
        child.send_signal(signum)
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGUSR1)
            time.sleep(1)
            child.kill()
            try:
                output = child.communicate(timeout=5)[1]
            except subprocess.TimeoutExpired:  # a worker it left behind holds the pipe
                output = "(the child's output stayed open)"
            pytest.fail(f"the child did not end after {signum.name}; its stack and output:\n{output}")
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode != 0  # the signal still ends the program
    assert list_namespaces(prefix) == []


@pytest.mark.launches
@pytest.mark.timeout(60)
def test_a_killed_runs_namespaces_are_removed_by_the_next_cluster_and_a_live_ones_kept(needs_cluster):
    # A run SIGKILLed mid-way leaves its namespaces, and whatever runs inside, behind.
    gone = subprocess.run([PY, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    orphan, live = f"gs{int(gone.stdout)}c9h0", f"gs{os.getpid()}c9h0"
    for name in (orphan, live):
        subprocess.run(["ip", "netns", "add", name], check=True)
    left = subprocess.Popen(["ip", "netns", "exec", orphan, PY, "-c", "import time; time.sleep(60)"])
    try:
        with SimulatedCluster(ClusterSpec(hosts=2, link="1gbit")):
            assert orphan not in list_namespaces("gs") and live in list_namespaces("gs")
        assert left.wait(timeout=20) != 0  # ended with its namespace
    finally:
        left.kill()
        for name in (orphan, live):
            subprocess.run(["ip", "netns", "del", name], check=False)
