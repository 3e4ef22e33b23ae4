"""A real Slurm cluster on this machine: one slurmd per simulated host, for `make slurm-check`.

The hosts are gradsync.bench.cluster's network namespaces. Each host also gets a hostname of its
own and an /etc/hosts that maps every node's name to its address (a UTS and a mount namespace,
held open by one idle process per host), so what a recipe does on a real cluster works unchanged:
`scontrol show hostnames` gives names, the first node's name reaches its rendezvous store, Gloo
finds each host's address from its hostname, and torchrun's c10d rendezvous knows which node
serves. slurmctld runs on node0, as on a cluster whose first node is also the head.

Nothing outside the run folder is used or changed: munged runs privately (its key, socket and
logs in the folder; `AuthInfo=socket=` points Slurm at it), so /etc/munge, /etc/slurm and
/run/munge stay as they are. `close()` stops every daemon and deletes the namespaces with
whatever still runs in them.

Two pitfalls found on the way (Slurm 22.05): slurmd must enter its namespace with `nsenter`, not
`ip netns exec`, which remounts /sys so that slurmd finds no cgroup and refuses to start; and
slurmctld checks that its host's name is the one slurm.conf gives it (`SlurmctldHost`).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradsync.bench.cluster import ClusterSpec, SimulatedCluster, stop_session

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
# How long the nodes may take to register with slurmctld (a few seconds when idle).
NODES_UP_S = 60.0
# Client commands answer at once from a live controller; a minute means it is gone.
CLIENT_TIMEOUT_S = 60.0
# How long a launch credential stays valid, and a requeued job waits before it starts again.
REQUEUE_HOLD_S = 30


class SlurmError(RuntimeError):
    """The Slurm cluster could not be started or answered wrongly (the message says which step)."""


@dataclass(frozen=True)
class SlurmSpec:
    """The shape of the cluster: nodes, their CPUs and GPUs as Slurm sees them, and the link.

    gpus_per_node: generic resources named `gpu`, backed by /dev/zero, so that `--gpus-per-node`
    and SLURM_GPUS_PER_NODE behave as on a GPU cluster; CUDA sees none of them.
    task_plugin: task/affinity binds each task to its `--cpus-per-task` cores, as most sites do.
    """

    nodes: int = 2
    cpus_per_node: int = 2
    gpus_per_node: int = 1
    link: str = "1gbit"
    task_plugin: str = "task/affinity"

    def node_names(self) -> list[str]:
        return [f"node{i}" for i in range(self.nodes)]


def missing_packages() -> list[str]:
    """The Debian packages whose daemons or clients are not on this machine."""
    tools = {"slurmctld": "slurmctld", "slurmd": "slurmd", "slurm-client": "sbatch", "munge": "munged"}
    return [package for package, tool in tools.items() if shutil.which(tool) is None]


def install_packages(packages: Sequence[str]) -> None:
    """apt-get install, without starting the services (policy-rc.d; the check runs its own daemons)."""
    if not packages:
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    policy = Path("/usr/sbin/policy-rc.d")
    ours = not policy.exists()
    if ours:  # 101: "action forbidden", so the packages' scripts start nothing
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    try:
        for argv in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", *packages]):
            done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise SlurmError(f"`{' '.join(argv)}` failed:\n{(done.stderr or done.stdout)[-2000:]}")
    finally:
        if ours:
            policy.unlink()


def slurm_conf(spec: SlurmSpec, controller: str, addresses: Sequence[str], folder: Path, munge_socket: Path) -> str:
    """slurm.conf for `spec`: every path in `folder`, nodes at `addresses`, node0 the controller.

    `controller` is the controller's hostname (slurmctld compares it with its own).
    """
    names = spec.node_names()
    lines = [
        "ClusterName=gradsync",
        f"SlurmctldHost={controller}({addresses[0]})",
        "MailProg=/bin/true",
        "AuthType=auth/munge",
        # cred_expire also holds a requeued job back (120 s by default) before it may start again.
        f"AuthInfo=socket={munge_socket},cred_expire={REQUEUE_HOLD_S}",
        "CredType=cred/munge",
        "MpiDefault=none",
        # linuxproc finds a step's processes by parentage; no cgroup hierarchy of our own is needed.
        "ProctrackType=proctrack/linuxproc",
        f"TaskPlugin={spec.task_plugin}",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "SchedulerType=sched/builtin",
        # A requeued job whose hold ran out waits for the next periodic pass (60 s by default).
        "SchedulerParameters=sched_interval=5",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        # A node that stops answering comes back by itself once its slurmd does.
        "ReturnToService=2",
        "SlurmUser=root",
        "SlurmdUser=root",
        # How long a cancelled step's processes get between SIGTERM and SIGKILL (Slurm's default).
        "KillWait=30",
        f"StateSaveLocation={folder}/state",
        f"SlurmdSpoolDir={folder}/spool-%n",
        f"SlurmctldPidFile={folder}/slurmctld.pid",
        f"SlurmdPidFile={folder}/slurmd-%n.pid",
        f"SlurmctldLogFile={folder}/slurmctld.log",
        f"SlurmdLogFile={folder}/slurmd-%n.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
    ]
    gres = f" Gres=gpu:{spec.gpus_per_node}" if spec.gpus_per_node else ""
    if spec.gpus_per_node:
        lines.append("GresTypes=gpu")
    for name, address in zip(names, addresses):
        lines.append(f"NodeName={name} NodeAddr={address} CPUs={spec.cpus_per_node} RealMemory=2000{gres} State=UNKNOWN")
    lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def gres_conf(spec: SlurmSpec) -> str:
    """Each node's GPUs as files slurmd can open: without a File, slurmd counts none and Slurm
    marks the node invalid."""
    return "".join(f"NodeName={name} Name=gpu File=/dev/zero\n" for name in spec.node_names()) if spec.gpus_per_node else ""


def hosts_file(names: Sequence[str], addresses: Sequence[str]) -> str:
    return "127.0.0.1 localhost\n" + "".join(f"{address} {name}\n" for name, address in zip(names, addresses))


_FIELD = re.compile(r"(\w+)=(\S*)")


def job_fields(text: str) -> dict[str, str]:
    """`scontrol show job -o ID`'s one line as a mapping (JobState, ExitCode, Restarts, ...)."""
    return dict(_FIELD.findall(text))


class SlurmCluster:
    """Start with `with SlurmCluster(folder, spec) as slurm:`; `submit`, `wait`, `command`."""

    def __init__(self, folder: Path, spec: SlurmSpec | None = None) -> None:
        self.spec = spec if spec is not None else SlurmSpec()
        self.folder = folder
        self.conf = folder / "slurm.conf"
        self._hosts = SimulatedCluster(ClusterSpec(hosts=self.spec.nodes, link=self.spec.link))
        self._holders: list[subprocess.Popen[Any]] = []
        self._daemons: list[subprocess.Popen[Any]] = []

    def __enter__(self) -> SlurmCluster:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def names(self) -> list[str]:
        return self.spec.node_names()

    @property
    def addresses(self) -> list[str]:
        return [host.address for host in self._hosts.hosts]

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment client commands run with (and that jobs inherit from sbatch)."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        return env

    # -- lifecycle --

    def _start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._start_munge()
        self._hosts.open()
        (self.folder / "hosts").write_text(hosts_file(self.names, self.addresses))
        for name, host in zip(self.names, self._hosts.hosts):
            self._holders.append(self._hold(name, host.name))
        self.conf.write_text(slurm_conf(self.spec, self.names[0], self.addresses, self.folder, self._munge_socket))
        (self.folder / "gres.conf").write_text(gres_conf(self.spec))
        (self.folder / "state").mkdir(exist_ok=True)
        self._daemons.append(self.popen(0, ["slurmctld", "-D", "-f", str(self.conf)], log="slurmctld.out"))
        for index, name in enumerate(self.names):
            (self.folder / f"spool-{name}").mkdir(exist_ok=True)
            self._daemons.append(self.popen(index, ["slurmd", "-D", "-f", str(self.conf)], log=f"slurmd-{name}.out"))
        self._wait_nodes_idle()

    def _start_munge(self) -> None:
        key = self.folder / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._munge_socket = self.folder / "munge.socket"
        argv = ["munged", "--foreground", "--force", f"--key-file={key}", f"--socket={self._munge_socket}",
                f"--pid-file={self.folder / 'munged.pid'}", f"--log-file={self.folder / 'munged.log'}",
                f"--seed-file={self.folder / 'munged.seed'}"]
        self._daemons.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                              stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + 10
        while not self._munge_socket.exists():
            if self._daemons[-1].poll() is not None or time.monotonic() > deadline:
                raise SlurmError(f"munged did not start: {self._tail(self.folder / 'munged.log')}")
            time.sleep(0.05)

    def _hold(self, name: str, namespace: str) -> subprocess.Popen[Any]:
        """An idle process that keeps host `name`'s namespaces open: its network namespace, and a
        hostname and /etc/hosts of its own. Everything that runs on the host enters them."""
        script = f"hostname {name} && mount --bind {self.folder / 'hosts'} /etc/hosts && echo ready && exec sleep infinity"
        holder = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{namespace}", "unshare", "--uts", "--mount", "--propagation", "private",
             "sh", "-c", script],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        assert holder.stdout is not None
        line = holder.stdout.readline().strip()
        if line != "ready":
            raise SlurmError(f"host {name} could not be set up: {line}{holder.stdout.read()}")
        return holder

    def _wait_nodes_idle(self) -> None:
        deadline = time.monotonic() + NODES_UP_S
        while True:
            states = self.command(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout.split()
            states = dict(zip(states[::2], states[1::2]))
            if all(states.get(name) == "idle" for name in self.names):
                return
            for daemon in self._daemons:
                if daemon.poll() is not None:
                    raise SlurmError(f"`{' '.join(map(str, daemon.args))}` exited with {daemon.returncode}:\n"
                                     + self._tail(self.folder / "slurmctld.log") + "\n" + self._logs_of_nodes())
            if time.monotonic() > deadline:
                raise SlurmError(f"the nodes did not come up within {NODES_UP_S:.0f} s ({states}):\n" + self._logs_of_nodes())
            time.sleep(0.5)

    def close(self) -> None:
        """Cancel every job, stop the daemons, delete the hosts with whatever still runs on them."""
        if self._daemons and self.conf.exists():
            self.command(["scancel", "--full", "--user", "root"], check=False, timeout=10)
        for process in reversed(self._daemons):
            stop_session(process, grace_s=5.0)
        self._daemons = []
        for holder in self._holders:
            stop_session(holder, grace_s=5.0)
        self._holders = []
        self._hosts.close()

    # -- using it --

    def popen(self, node: int, argv: Sequence[str], log: str | None = None, **kwargs: Any) -> subprocess.Popen[Any]:
        """Start `argv` on node `node`, inside its namespaces (stdout and stderr to `log` in the folder)."""
        holder = self._holders[node].pid
        if log is not None:
            kwargs["stdout"] = open(self.folder / log, "ab")  # noqa: SIM115 - the child holds it
            kwargs["stderr"] = subprocess.STDOUT
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        kwargs.setdefault("env", self.env())
        kwargs.setdefault("start_new_session", True)
        process = subprocess.Popen(_enter(holder, kwargs.pop("cwd", None), argv), **kwargs)
        if log is not None:
            kwargs["stdout"].close()
        return process

    def command(self, argv: Sequence[str], node: int = 0, check: bool = True, timeout: float = CLIENT_TIMEOUT_S,
                cwd: Path | None = None, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run a client command (sbatch, scancel, scontrol, ...) on node `node` and wait for it."""
        holder = self._holders[node].pid
        done = subprocess.run(_enter(holder, cwd, argv), env=self.env(env), capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, check=False)
        if check and done.returncode != 0:
            raise SlurmError(f"`{' '.join(argv)}` failed ({done.returncode}): {(done.stderr or done.stdout).strip()}")
        return done

    def submit(self, script: Path, cwd: Path, env: Mapping[str, str] | None = None, options: Sequence[str] = ()) -> str:
        """sbatch `script` from `cwd` (the submission folder); returns the job id."""
        done = self.command(["sbatch", "--parsable", *options, str(script)], cwd=cwd, env=env)
        return done.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        return job_fields(self.command(["scontrol", "show", "job", "-o", job_id]).stdout)

    def wait(self, job_id: str, timeout_s: float, states: Sequence[str] = ("COMPLETED", "FAILED", "CANCELLED",
                                                                         "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")) -> dict[str, str]:
        """Poll the job until its state is one of `states`; its fields then."""
        deadline = time.monotonic() + timeout_s
        while True:
            fields = self.job(job_id)
            if fields.get("JobState") in states:
                return fields
            if time.monotonic() > deadline:
                raise SlurmError(f"job {job_id} is still {fields.get('JobState')} after {timeout_s:.0f} s "
                                 f"(waiting for {', '.join(states)})")
            time.sleep(0.5)

    def pids(self, node: int, pattern: str) -> list[int]:
        """The processes on node `node` whose command line contains `pattern`."""
        return [pid for pid, line in self._hosts.processes(node) if pattern in line]

    def _logs_of_nodes(self) -> str:
        return "\n".join(f"{name}: {self._tail(self.folder / f'slurmd-{name}.log')}" for name in self.names)

    @staticmethod
    def _tail(path: Path, lines: int = 15) -> str:
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return f"({path.name}: none)"


def _enter(holder: int, cwd: Path | None, argv: Sequence[str]) -> list[str]:
    """`argv` inside the namespaces of the host that `holder` keeps, in `cwd` (nsenter would
    otherwise start it in /, the working folder of the holder's mount namespace)."""
    return ["nsenter", "--target", str(holder), "--net", "--uts", "--mount", f"--wd={cwd or os.getcwd()}", *argv]
