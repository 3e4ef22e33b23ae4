"""A simulated multi-host cluster on one Linux machine: network namespaces joined by a shaped link.

Multi-host behaviour (rendezvous across addresses, Gloo picking an interface, all-reduce bound by
the network instead of by memory bandwidth) cannot be seen on localhost, and a real cluster is
not always at hand. Each "host" here is a network namespace with its own interface and address;
the link between hosts is a veth pair (2 hosts) or a bridge in a separate "switch" namespace
(more hosts), shaped with `tc tbf` so a benchmark sees the bandwidth of the configured link, not
the memory bandwidth of the machine. Processes on the hosts share the file system, the CPUs and
the GPUs: only the network is simulated.

    with SimulatedCluster(ClusterSpec(hosts=2, link="1gbit")) as cluster:
        procs = [
            cluster.run(i, [sys.executable, "-m", "torch.distributed.run",
                            *cluster.torchrun_args(i, nproc_per_node=1, master_port=29500),
                            "train.py"])
            for i in range(len(cluster.hosts))
        ]
        codes = [p.wait() for p in procs]

or from a shell (`{node_rank}` etc. are replaced per host):

    python -m gradsync.bench.cluster --hosts 2 --link 300mbit -- \\
        python -m torch.distributed.run --nnodes {nnodes} --node-rank {node_rank} \\
        --master-addr {master_addr} --master-port {master_port} --nproc-per-node 1 train.py

Building it needs root (namespaces, links and qdiscs are privileged); `available()` says whether
it can be built here and why not, so a benchmark can fall back to localhost. Every namespace is
deleted on `close()`, at interpreter exit and on SIGTERM/SIGINT: leftover namespaces would keep
interfaces and processes alive invisibly.
"""

from __future__ import annotations

import argparse
import atexit
import ipaddress
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, Any

import psutil

from gradsync.distributed import threads_per_worker
from gradsync.errors import ConfigError, GradsyncError

__all__ = [
    "ClusterError",
    "ClusterSpec",
    "Host",
    "SimulatedCluster",
    "available",
    "list_namespaces",
    "remove_orphans",
    "main",
    "run_torchrun",
    "FIRST_MASTER_PORT",
]

# tc's rate units ("bps" is bytes per second in tc, "bit" bits per second; IEC variants too).
_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)([kmgt]i?)?(bit|bps)$", re.IGNORECASE)
_TIME_RE = re.compile(r"^\d+(?:\.\d+)?(?:us|usec|ms|msec|s|sec)$", re.IGNORECASE)
_PREFIXES = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
# Host i gets <subnet>.(i+1); .0 and .255 are the network and broadcast addresses.
_MAX_HOSTS = 254
# Queueing delay tbf tolerates before it drops: generous, so TCP sees a slow link, not a lossy one.
_TBF_LATENCY = "100ms"
_COMMAND_TIMEOUT_S = 30.0
# Master ports inside the hosts' own namespaces start below Linux's ephemeral range (32768-60999):
# a port picked free on the machine can, inside a namespace, be the local end of the last job's
# connections (Gloo's, from the job before) and fail to listen: EADDRINUSE, seen on a benchmark's second job.
FIRST_MASTER_PORT = 29500
# Resolved on our PATH: Popen would look `ip` up on the PATH of the env a caller passes to run().
_IP = shutil.which("ip") or "ip"


class ClusterError(GradsyncError):
    """The simulated cluster could not be built on this machine (the message says why)."""


@dataclass(frozen=True)
class ClusterSpec:
    """The shape of a simulated cluster.

    hosts: number of hosts (network namespaces), at least 2.
    link: bandwidth of each host's link in tc rate syntax ("300mbit", "1gbit", "10gbit").
    delay: one-way delay added on every egress in tc time syntax ("1ms"), via netem.
    loss: percentage of packets dropped on every egress (0.1 = 0.1 %), via netem.
    """

    hosts: int = 2
    link: str = "1gbit"
    delay: str | None = None
    loss: float | None = None

    def __post_init__(self) -> None:
        # Validated here so a typo fails before any namespace exists, with a message a user can act on.
        if isinstance(self.hosts, bool) or not isinstance(self.hosts, int) or not 2 <= self.hosts <= _MAX_HOSTS:
            raise ConfigError(
                f"hosts={self.hosts!r}: a simulated cluster needs an integer between 2 and {_MAX_HOSTS} hosts"
            )
        if not isinstance(self.link, str) or _RATE_RE.match(self.link.strip()) is None:
            raise ConfigError(
                f"link={self.link!r} is not a tc rate: use a number and a unit such as "
                "'300mbit', '1gbit' or '10gbit' (bit, kbit, mbit, gbit, tbit; bps units are bytes/s)"
            )
        if self.link_bits_per_second <= 0:
            raise ConfigError(f"link={self.link!r}: the rate must be above zero")
        if self.delay is not None and (not isinstance(self.delay, str) or _TIME_RE.match(self.delay.strip()) is None):
            raise ConfigError(
                f"delay={self.delay!r} is not a tc time: use a number and a unit such as '500us', '1ms' or '0.1s'"
            )
        if self.loss is not None and (
            isinstance(self.loss, bool) or not isinstance(self.loss, (int, float)) or not 0 <= self.loss <= 100
        ):
            raise ConfigError(f"loss={self.loss!r}: give a packet-loss percentage between 0 and 100")

    @property
    def link_bits_per_second(self) -> float:
        """The link rate in bit/s (to size tbf's burst and to compare measured rates with)."""
        match = _RATE_RE.match(self.link.strip())
        assert match is not None
        number, prefix, unit = match.groups()
        factor = _PREFIXES[(prefix or "").lower()] * (8 if unit.lower() == "bps" else 1)
        return float(number) * factor

    @property
    def needs_netem(self) -> bool:
        """Delay and loss need the netem qdisc, which some kernels (minimal VMs) do not have."""
        return self.delay is not None or bool(self.loss)


@dataclass(frozen=True)
class Host:
    """One simulated host: its network namespace, its address and its interface."""

    name: str
    address: str
    interface: str


# --- running ip/tc ------------------------------------------------------------------------------


def _cmd(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one ip/tc command; a failure raises ClusterError with the command and its message."""
    try:
        done = subprocess.run(
            list(argv),
            check=False,
            capture_output=True,
            text=True,
            timeout=_COMMAND_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        if check:
            raise ClusterError(f"`{' '.join(argv)}` failed: {error}") from error
        return subprocess.CompletedProcess(list(argv), 1, "", str(error))
    if check and done.returncode != 0:
        raise ClusterError(f"`{' '.join(argv)}` failed: {(done.stderr or done.stdout).strip()}")
    return done


def _pids_in(namespace: str) -> list[int]:
    return [int(pid) for pid in _cmd("ip", "netns", "pids", namespace, check=False).stdout.split() if pid.isdigit()]


def _kill_everything_in(namespace: str) -> None:
    for pid in _pids_in(namespace):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def list_namespaces(prefix: str | None = None) -> list[str]:
    """Names of the network namespaces that start with `prefix` (default: this process's prefix).

    Useful to check that nothing was left behind.
    """
    prefix = _process_prefix() if prefix is None else prefix
    done = _cmd("ip", "netns", "list", check=False)
    names = [line.split()[0] for line in done.stdout.splitlines() if line.strip()]
    return [name for name in names if name.startswith(prefix)]


def _delete_namespace(name: str) -> None:
    # Anything still inside (a process that left its session, a grandchild) would keep the
    # namespace and its links alive after `ip netns del`: end it first.
    _kill_everything_in(name)
    host = re.search(r"h(\d+)$", name)
    if host is not None:  # one end of a veth pair removes the other
        _cmd("ip", "-n", name, "link", "del", f"gs{host.group(1)}", check=False)
    elif name.endswith("sw"):
        _cmd("ip", "-n", name, "link", "del", "br0", check=False)
    _cmd("ip", "netns", "del", name, check=False)


_OWNED = re.compile(r"^gs(\d+)c")


def remove_orphans() -> list[str]:
    """Delete the namespaces an earlier gradsync process made and could not delete (it was
    SIGKILLed: no handler runs), with whatever still runs inside them; returns their names.

    Only names of gradsync's own pattern (gs<pid>c...) whose process is gone are touched: a live
    owner (another run beside this one) keeps its cluster."""
    removed = []
    for name in list_namespaces("gs"):
        owner = _OWNED.match(name)
        if owner is None or psutil.pid_exists(int(owner.group(1))):
            continue
        _delete_namespace(name)
        removed.append(name)
    return removed


def _process_prefix() -> str:
    # The pid keeps parallel runs (pytest-xdist, two benchmarks) from colliding.
    return f"gs{os.getpid()}c"


def _pick_subnet() -> str:
    """A 10.213.x.0/24 that no interface of the host uses, so addresses are never ambiguous.

    The namespaces are not routed to the host, so a clash would not break anything; avoiding it
    keeps logs and `ip addr` output unambiguous.
    """
    done = _cmd("ip", "-o", "-4", "addr", "show", check=False)
    used = []
    for match in re.finditer(r"inet (\S+)", done.stdout):
        try:
            used.append(ipaddress.ip_interface(match.group(1)).network)
        except ValueError:
            continue
    for third in range(1, 255):
        candidate = ipaddress.ip_network(f"10.213.{third}.0/24")
        if not any(candidate.overlaps(network) for network in used):
            return f"10.213.{third}"
    raise ClusterError("no free 10.213.x.0/24 subnet: every one overlaps an address of this machine")


# --- availability -------------------------------------------------------------------------------

_probe_lock = threading.Lock()
_probe_result: tuple[str | None, bool] | None = None


def _probe() -> tuple[str | None, bool]:
    """Try once what the cluster needs; returns (reason it cannot be built or None, netem works)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux; falling back to localhost", False
    if os.geteuid() != 0:
        return "needs root to create network namespaces; falling back to localhost", False
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed; falling back to localhost", False
    name = f"{_process_prefix()}probe"
    _cmd("ip", "netns", "del", name, check=False)
    try:
        _cmd("ip", "netns", "add", name)
        _cmd("ip", "-n", name, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
        _cmd("tc", "-n", name, "qdisc", "add", "dev", "p0", "root", "tbf", "rate", "1gbit", "burst", "128kb",
             "latency", _TBF_LATENCY)
        netem = _cmd("tc", "-n", name, "qdisc", "add", "dev", "p1", "root", "netem", "delay", "1ms",
                     check=False).returncode == 0
    except ClusterError as error:
        return f"cannot build network namespaces here ({error}); falling back to localhost", False
    finally:
        _cmd("ip", "netns", "del", name, check=False)
    return None, netem


def available(spec: ClusterSpec | None = None) -> str | None:
    """None when a simulated cluster (of `spec`, if given) can be built here, else a one-line reason.

    Benchmarks call this to fall back to localhost instead of failing. The probe (creating and
    deleting a throwaway namespace) runs once per process; its result is cached.
    """
    global _probe_result
    with _probe_lock:
        if _probe_result is None:
            _probe_result = _probe()
        reason, netem = _probe_result
    if reason is None and spec is not None and spec.needs_netem and not netem:
        return "the kernel has no netem qdisc, so delay/loss cannot be simulated (the link rate can)"
    return reason


# --- cleanup on exit and signals ----------------------------------------------------------------

# Strong references: a cluster dropped without close() must still be cleaned up at exit.
_open_clusters: set[SimulatedCluster] = set()
_previous_handlers: dict[int, Any] = {}
_counter = itertools.count()


def _close_all() -> None:
    for cluster in list(_open_clusters):
        cluster.close()


atexit.register(_close_all)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    """Delete the namespaces, then do what the signal would have done without us."""
    previous = _previous_handlers.get(signum, signal.SIG_DFL)  # before close() restores handlers
    _close_all()
    if callable(previous):
        previous(signum, frame)  # e.g. SIGINT's default: raise KeyboardInterrupt
    elif previous == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _install_signal_handlers() -> None:
    # Python's handler for SIGTERM is "die at once", which would skip atexit; ours cleans first.
    if _previous_handlers or threading.current_thread() is not threading.main_thread():
        return  # installed already, or not allowed from this thread (atexit still cleans up)
    for signum in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(signum)
        if previous == signal.SIG_IGN:
            continue
        _previous_handlers[signum] = previous
        signal.signal(signum, _on_signal)


def _restore_signal_handlers() -> None:
    if _open_clusters or threading.current_thread() is not threading.main_thread():
        return
    for signum, previous in list(_previous_handlers.items()):
        if signal.getsignal(signum) is _on_signal:
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        del _previous_handlers[signum]


# --- the cluster --------------------------------------------------------------------------------


class SimulatedCluster:
    """N hosts as network namespaces joined by shaped links; a context manager that cleans up.

    The namespaces are created on `__enter__` (or `open()`) and deleted, with every process still
    running in them, on `close()` / `__exit__` / interpreter exit / SIGTERM / SIGINT.
    """

    def __init__(self, spec: ClusterSpec | None = None) -> None:
        self.spec = spec if spec is not None else ClusterSpec()
        # "-" ends the prefix so cluster 1's prefix does not also match cluster 10's namespaces.
        self.prefix = f"{_process_prefix()}{next(_counter)}-"
        self._hosts: list[Host] = []
        self._namespaces: list[str] = []  # every namespace created so far, for a partial cleanup
        self._processes: list[subprocess.Popen[Any]] = []
        self._opened = False

    # -- lifecycle --

    def __enter__(self) -> SimulatedCluster:
        self.open()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def open(self) -> SimulatedCluster:
        """Create namespaces, links, addresses and qdiscs; on any failure undo what was done."""
        if self._opened:
            return self
        reason = available(self.spec)
        if reason is not None:
            raise ClusterError(f"cannot build a simulated cluster: {reason}")
        self._opened = True
        _open_clusters.add(self)
        _install_signal_handlers()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        spec = self.spec
        subnet = _pick_subnet()
        # Namespaces of earlier runs that were killed before they could delete them.
        remove_orphans()
        # Reuse of our pid by a crashed earlier run could leave a namespace with our name behind.
        existing = set(list_namespaces(self.prefix))
        names = [f"{self.prefix}h{i}" for i in range(spec.hosts)]
        switch = f"{self.prefix}sw" if spec.hosts > 2 else None
        for name in [*names, *([switch] if switch else [])]:
            if name in existing:
                _cmd("ip", "netns", "del", name, check=False)
            self._namespaces.append(name)  # recorded first: a half-made namespace is deleted too
            _cmd("ip", "netns", "add", name)
            _cmd("ip", "-n", name, "link", "set", "lo", "up")
        for i, name in enumerate(names):
            self._hosts.append(Host(name=name, address=f"{subnet}.{i + 1}", interface=f"gs{i}"))

        shaped: list[tuple[str, str]] = []  # (namespace, interface) whose egress gets the link's rate
        if switch is None:
            a, b = self._hosts
            # Created straight inside the namespaces: no name ever appears in the host's namespace.
            _cmd("ip", "link", "add", a.interface, "netns", a.name, "type", "veth",
                 "peer", "name", b.interface, "netns", b.name)
            shaped += [(a.name, a.interface), (b.name, b.interface)]
        else:
            _cmd("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
            for i, host in enumerate(self._hosts):
                port = f"sw{i}"
                _cmd("ip", "link", "add", host.interface, "netns", host.name, "type", "veth",
                     "peer", "name", port, "netns", switch)
                _cmd("ip", "-n", switch, "link", "set", port, "master", "br0")
                _cmd("ip", "-n", switch, "link", "set", port, "up")
                # Both directions of each host's link: egress of the host and egress of the switch port.
                shaped += [(host.name, host.interface), (switch, port)]
            _cmd("ip", "-n", switch, "link", "set", "br0", "up")
        for host in self._hosts:
            # No IPv6 link-local address: Gloo must find exactly the IPv4 address on the interface.
            _cmd("ip", "-n", host.name, "link", "set", host.interface, "addrgenmode", "none", check=False)
            _cmd("ip", "-n", host.name, "addr", "add", f"{host.address}/24", "dev", host.interface)
            _cmd("ip", "-n", host.name, "link", "set", host.interface, "up")
        for namespace, interface in shaped:
            self._shape(namespace, interface)

    def _shape(self, namespace: str, interface: str) -> None:
        spec = self.spec
        # Burst: ~4 ms of line rate, at least 128 KiB so veth's 64 KiB GSO packets pass whole. Small
        # enough that a short transfer is not mostly burst (the measured rate is the link's rate).
        burst = max(128 * 1024, int(spec.link_bits_per_second / 8 / 250))
        tbf = ["tbf", "rate", spec.link.strip().lower(), "burst", str(burst), "latency", _TBF_LATENCY]
        if not spec.needs_netem:
            _cmd("tc", "-n", namespace, "qdisc", "add", "dev", interface, "root", *tbf)
            return
        netem = ["netem"]
        if spec.delay is not None:
            netem += ["delay", spec.delay.strip().lower()]
        if spec.loss:
            netem += ["loss", f"{spec.loss}%"]
        # netem delays/drops, its child tbf limits the rate.
        _cmd("tc", "-n", namespace, "qdisc", "add", "dev", interface, "root", "handle", "1:", *netem)
        _cmd("tc", "-n", namespace, "qdisc", "add", "dev", interface, "parent", "1:1", "handle", "10:", *tbf)

    def close(self) -> None:
        """Stop every process still running on the hosts, delete every namespace. Idempotent.

        Safe to call after a half-finished `open()` and from a signal handler in the middle of
        another `close()`: it works from lists it shrinks as it goes.
        """
        for process in list(self._processes):
            stop_session(process)
            if process in self._processes:
                self._processes.remove(process)
        for name in list(reversed(self._namespaces)):
            _delete_namespace(name)
            if name in self._namespaces:
                self._namespaces.remove(name)
        self._hosts = []
        if self._opened:
            self._opened = False
            _open_clusters.discard(self)
            _restore_signal_handlers()

    # -- using it --

    @property
    def hosts(self) -> list[Host]:
        """The hosts, in node-rank order (host 0 serves torchrun's rendezvous)."""
        return list(self._hosts)

    def env(self, host_index: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """`base` (default: this process's environment) plus the variables that pin Gloo/NCCL to the link.

        Without GLOO_SOCKET_IFNAME Gloo resolves the hostname, which does not resolve inside a
        namespace (and would name the host's interface, not the simulated one).
        """
        host = self._host(host_index)
        env = dict(os.environ if base is None else base)
        env["GLOO_SOCKET_IFNAME"] = host.interface
        env["NCCL_SOCKET_IFNAME"] = host.interface
        return env

    def run(
        self,
        host_index: int,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        **popen_kwargs: Any,
    ) -> subprocess.Popen[Any]:
        """Start `argv` on host `host_index` (`ip netns exec`); the process is stopped on close().

        `env` replaces this process's environment, as with Popen; the *_SOCKET_IFNAME variables are
        added either way. `argv[0]` is looked up on that environment's PATH (give the full path of
        an interpreter that is not on it, e.g. `sys.executable`). The process gets its own session
        so that close() can stop it with everything it started (torchrun's workers).
        """
        host = self._host(host_index)
        popen_kwargs.setdefault("start_new_session", True)
        process = subprocess.Popen(
            [_IP, "netns", "exec", host.name, *argv], env=self.env(host_index, env), **popen_kwargs
        )
        self._processes.append(process)
        return process

    def processes(self, host_index: int) -> list[tuple[int, str]]:
        """The processes running on host `host_index` now: their PIDs and command lines (arguments
        joined by spaces), so that a harness can wait for some of them to end or strike at them."""
        found = []
        for pid in _pids_in(self._host(host_index).name):
            try:
                found.append((pid, Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")))
            except OSError:
                pass  # it ended meanwhile
        return found

    def command_lines(self, host_index: int) -> list[str]:
        """The command lines of the processes running on host `host_index` now (see `processes`)."""
        return [line for _, line in self.processes(host_index)]

    def kill_host(self, host_index: int) -> None:
        """The host dies: SIGKILL every process on it at once, launcher and workers alike (torchrun
        starts workers in sessions of their own, so killing the launcher's group is not enough)."""
        _kill_everything_in(self._host(host_index).name)

    def torchrun_args(self, host_index: int, nproc_per_node: int, master_port: int = FIRST_MASTER_PORT) -> list[str]:
        """torchrun options for static rendezvous on host `host_index`, served by host 0.

        Static (not c10d) rendezvous because it needs nothing but an address: c10d would also need
        --local-addr and is_host settings, as the hostname does not resolve in a namespace.
        """
        self._host(host_index)
        return [
            "--nnodes", str(len(self._hosts)),
            "--node-rank", str(host_index),
            "--master-addr", self._hosts[0].address,
            "--master-port", str(master_port),
            "--nproc-per-node", str(nproc_per_node),
        ]

    def _host(self, index: int) -> Host:
        if not self._hosts:
            raise ClusterError("the cluster is not open: use `with SimulatedCluster(spec) as cluster:`")
        if not 0 <= index < len(self._hosts):
            raise ConfigError(f"host index {index} is out of range: this cluster has {len(self._hosts)} hosts")
        return self._hosts[index]


def stop_session(process: subprocess.Popen[Any], grace_s: float = 3.0) -> None:
    """SIGTERM the process's group (it has its own session), then SIGKILL after `grace_s`."""
    if process.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except (ProcessLookupError, PermissionError):
            try:
                process.send_signal(sig)
            except ProcessLookupError:
                return
        try:
            process.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


# --- command line -------------------------------------------------------------------------------

_PLACEHOLDERS = ("node_rank", "nnodes", "master_addr", "master_port", "address")


def _substitute(argv: Sequence[str], values: Mapping[str, str]) -> list[str]:
    # Plain replacement of the known names only: other braces (python -c "d = {}") stay as they are.
    out = []
    for arg in argv:
        for key in _PLACEHOLDERS:
            arg = arg.replace("{" + key + "}", values[key])
        out.append(arg)
    return out


def _pump(stream: IO[bytes], prefix: str, lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace").rstrip("\n")
        with lock:
            sys.stdout.write(f"{prefix}{line}\n")
            sys.stdout.flush()
    stream.close()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gradsync.bench.cluster",
        description=(
            "Run COMMAND once per simulated host (a network namespace) joined by a shaped link. "
            "In COMMAND's arguments {node_rank}, {nnodes}, {master_addr}, {master_port} and "
            "{address} are replaced per host. Needs root."
        ),
        epilog=(
            "example: python -m gradsync.bench.cluster --hosts 2 --link 300mbit -- "
            "python -m torch.distributed.run --nnodes {nnodes} --node-rank {node_rank} "
            "--master-addr {master_addr} --master-port {master_port} --nproc-per-node 1 train.py"
        ),
    )
    parser.add_argument("--hosts", type=int, default=2, help="number of hosts (default 2)")
    parser.add_argument("--link", default="1gbit", help="bandwidth of each host's link, tc syntax (default 1gbit)")
    parser.add_argument("--delay", default=None, help="one-way delay per egress, e.g. 1ms (needs netem)")
    parser.add_argument("--loss", type=float, default=None, help="packet loss in percent, e.g. 0.1 (needs netem)")
    parser.add_argument("--master-port", type=int, default=29500, help="value of {master_port} (default 29500)")
    parser.add_argument(
        "--grace", type=float, default=10.0,
        help="seconds the other hosts get to finish after one host failed before they are stopped "
        "(a distributed job whose peer died usually hangs until its timeout; default 10)",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run a command on every simulated host; 0 if it succeeded everywhere. Always cleans up."""
    parser = _parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        parser.error("give the command to run after `--`")
    try:
        spec = ClusterSpec(hosts=args.hosts, link=args.link, delay=args.delay, loss=args.loss)
    except ConfigError as error:
        print(f"gradsync: {error}", file=sys.stderr)
        return 2
    reason = available(spec)
    if reason is not None:
        print(f"gradsync: cannot build a simulated cluster: {reason}", file=sys.stderr)
        return 2

    lock = threading.Lock()
    try:
        with SimulatedCluster(spec) as cluster:
            hosts = cluster.hosts
            processes, pumps = [], []
            for i, host in enumerate(hosts):
                values = {
                    "node_rank": str(i),
                    "nnodes": str(len(hosts)),
                    "master_addr": hosts[0].address,
                    "master_port": str(args.master_port),
                    "address": host.address,
                }
                process = cluster.run(
                    i, _substitute(command, values),
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                )
                pump = threading.Thread(target=_pump, args=(process.stdout, f"[host {i}] ", lock), daemon=True)
                pump.start()
                processes.append(process)
                pumps.append(pump)
            codes = wait_all(processes, args.grace, lock)
            for pump in pumps:
                pump.join(timeout=5.0)
    except ClusterError as error:
        print(f"gradsync: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the namespaces are gone already (signal handler, then __exit__)
        print("gradsync: interrupted; the simulated cluster was removed", file=sys.stderr)
        return 130
    failed = [i for i, code in enumerate(codes) if code != 0]
    if failed:
        with lock:
            print(
                "gradsync: " + ", ".join(f"host {i} exited with {codes[i]}" for i in failed),
                file=sys.stderr,
            )
        return 1
    return 0


def run_torchrun(cluster: SimulatedCluster, nproc_per_node: int, module_argv: Sequence[str], master_port: int,
                 grace_s: float = 10.0, environment: Mapping[str, str] | None = None) -> int:
    """`torchrun ... -m MODULE ARGS` on every host (static rendezvous); 0 if every host succeeded.
    `environment`: variables added to this process's environment for the workers.

    The simulated hosts share this machine's cores, and torchrun leaves a host's only worker
    PyTorch's default of one intra-op thread per core: with every host's workers doing so, the
    machine runs hosts x cores threads on its cores. Their parallel regions then wait for threads
    the scheduler has put aside (2 hosts x 1 worker on 2 cores: gradsync's PowerSGD at 19-40% of
    one worker's throughput, 94% with a thread each). So unless OMP_NUM_THREADS is given, each
    worker gets its share of the cores, as it would have on a host of its own.

    Output goes straight to this process's stdout/stderr, so rank 0's report reads as usual.
    """
    env = {**os.environ, **(environment or {})}
    env.setdefault("OMP_NUM_THREADS", str(threads_per_worker(len(cluster.hosts) * nproc_per_node)))
    processes = [
        cluster.run(i, [sys.executable, "-m", "torch.distributed.run",
                        *cluster.torchrun_args(i, nproc_per_node, master_port), "-m", *module_argv], env=env)
        for i in range(len(cluster.hosts))
    ]
    codes = wait_all(processes, grace_s, threading.Lock())
    return next((code for code in codes if code != 0), 0)


def wait_all(processes: list[subprocess.Popen[Any]], grace_s: float, lock: threading.Lock) -> list[int]:
    """Wait for every process; once one fails, the rest get `grace_s` seconds, then are stopped."""
    deadline: float | None = None
    while True:
        codes = [p.poll() for p in processes]
        if all(code is not None for code in codes):
            return [int(code) for code in codes]  # type: ignore[arg-type]
        if deadline is None and any(code not in (None, 0) for code in codes):
            deadline = time.monotonic() + grace_s
        if deadline is not None and time.monotonic() >= deadline:
            with lock:
                print(f"gradsync: a host failed; stopping the others after {grace_s:g} s", file=sys.stderr)
            for process in processes:
                stop_session(process)
            deadline = float("inf")
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
