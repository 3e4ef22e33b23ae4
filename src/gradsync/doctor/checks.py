"""The doctor's checks: pure functions from what they inspect to typed `Check` results.

Each function takes the values it judges (an environment mapping, a limit, a filesystem's size,
every rank's versions) and returns `Check`s; none of them reads the machine. Collecting those
values is `facts.py`'s job, so a test can hand a check a fake `RLIMIT_NOFILE`, a 64 MiB /dev/shm or
a synthetic mix of ranks without changing the machine it runs on.

A verdict is "ok", "warning" (works, but slower, noisier or fragile) or "problem" (a job will fail,
hang or give wrong results); every non-ok check says how to fix it.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from gradsync.netif import interface_of, is_loopback

Verdict = Literal["ok", "warning", "problem"]
VERDICTS: tuple[Verdict, ...] = ("ok", "warning", "problem")

MIB = 1 << 20
GIB = 1 << 30
# NCCL keeps per-peer buffers in /dev/shm (several MiB per channel and peer on one host); Docker's
# 64 MiB default makes it fail with "unhandled system error" once a few GPUs talk. 512 MiB is a
# floor, not a target: --shm-size=8g or --ipc=host are the usual settings.
SHM_MIN_BYTES = 512 * MIB
# Every rank holds sockets to its peers (Gloo: a pair per peer, NCCL more), the store's client,
# CUDA's and the DataLoader workers' descriptors; 1024, a common default, runs out on large jobs.
NOFILE_MIN = 4096
# Checkpoints of a model trained with Adam weigh about 12-16 bytes per parameter (fp32 weights and
# two moments). gradsync keeps 3 and writes a 4th before removing the oldest: 10 GiB holds that
# for a model of roughly 150-200M parameters. Below 1 GiB even a small model's save may fail.
DISK_WARN_BYTES = 10 * GIB
DISK_PROBLEM_BYTES = 1 * GIB
# A pair whose bandwidth is below this share of the median pair is named as slow.
SLOW_PAIR_SHARE = 0.5


@dataclass(frozen=True)
class Check:
    """One line of the report: what was looked at, the verdict, and the fix when it is not ok."""

    name: str
    verdict: Verdict
    value: str
    message: str
    fix: str | None = None

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict {self.verdict!r}: use one of {', '.join(VERDICTS)}")
        if self.verdict != "ok" and not self.fix:
            raise ValueError(f"check {self.name!r} is {self.verdict} but says no fix")


def worst(verdicts: Iterable[str]) -> Verdict:
    """The most serious verdict ("ok" for none)."""
    return max(verdicts, key=VERDICTS.index, default="ok")  # type: ignore[return-value]


def ranks_text(ranks: Iterable[int]) -> str:
    """[0, 1, 2, 5] -> 'ranks 0-2,5'; [3] -> 'rank 3'."""
    ordered = sorted(set(ranks))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ("rank " if len(ordered) == 1 else "ranks ") + ",".join(parts)


def _with_hosts(ranks: Sequence[int], hosts: Mapping[int, str]) -> str:
    names = sorted({hosts[r] for r in ranks if r in hosts})
    return f"{ranks_text(ranks)} ({', '.join(names)})" if names else ranks_text(ranks)


# --- software ------------------------------------------------------------------------------------


def check_python(version: str) -> Check:
    return Check("python", "ok", version, "the interpreter the workers run")


def check_torch(version: str) -> Check:
    return Check("torch", "ok", version, "the torch build the workers import")


def check_cuda(cuda_version: str | None, available: bool, gpu_count: int) -> Check:
    if cuda_version is None:
        return Check("cuda", "ok", "none (CPU build of torch)", "training runs on the CPU, collectives on Gloo")
    if not available:
        return Check(
            "cuda", "warning", f"{cuda_version}, no usable GPU",
            f"torch is built for CUDA {cuda_version} but torch.cuda.is_available() is False: training would "
            "fall back to the CPU",
            "check `nvidia-smi` (driver loaded, GPUs visible), that the driver supports CUDA "
            f"{cuda_version}, and that CUDA_VISIBLE_DEVICES does not hide every GPU",
        )
    return Check("cuda", "ok", f"{cuda_version}, {gpu_count} GPU(s) usable", "torch sees the GPUs")


def check_nccl(available: bool, version: str | None, cuda_available: bool) -> Check:
    if available:
        return Check("nccl", "ok", version or "available", "the GPU collective backend")
    if cuda_available:
        return Check(
            "nccl", "problem", "missing",
            "this torch build has no NCCL although GPUs are usable: multi-GPU training cannot use NCCL",
            "install a CUDA build of torch from pytorch.org (they ship NCCL), e.g. "
            "`pip install torch --index-url https://download.pytorch.org/whl/cu124`",
        )
    return Check("nccl", "ok", "not in this build (not needed on CPU)", "not needed without GPUs (Gloo does the collectives)")


def check_gloo(available: bool) -> Check:
    if available:
        return Check("gloo", "ok", "available", "CPU collectives, and gradsync's control messages on GPU jobs")
    return Check(
        "gloo", "problem", "missing",
        "this torch build has no Gloo: CPU training and gradsync's control group cannot work",
        "install an official torch build (pip or conda from pytorch.org); they all include Gloo",
    )


@dataclass(frozen=True)
class Versions:
    """What one rank runs, for the comparison across ranks."""

    rank: int
    host: str
    python: str
    torch: str
    cuda: str | None
    nccl: str | None
    gloo: bool


def check_versions(ranks: Sequence[Versions]) -> Check:
    """Every rank must run the same Python, torch, CUDA, NCCL and Gloo: mixed builds fail or hang."""
    if len(ranks) <= 1:
        return Check("same versions", "ok", "1 rank (nothing to compare)", "nothing to compare")
    hosts = {r.rank: r.host for r in ranks}
    differences = []
    for field in ("python", "torch", "cuda", "nccl", "gloo"):
        by_value: dict[str, list[int]] = {}
        for r in ranks:
            value = getattr(r, field)
            text = ("available" if value else "missing") if field == "gloo" else (value or "none")
            by_value.setdefault(text, []).append(r.rank)
        if len(by_value) > 1:
            differences.append(
                f"{field}: " + "; ".join(f"{value} on {_with_hosts(rs, hosts)}" for value, rs in by_value.items())
            )
    if differences:
        return Check(
            "same versions", "problem", f"{len(differences)} difference(s)",
            "ranks run different builds: " + " | ".join(differences),
            "install one environment on every host (one container image, or the same pinned requirements): "
            "ranks with different torch, CUDA or NCCL builds can fail or hang in their first collective",
        )
    first = ranks[0]
    same = f"python {first.python}, torch {first.torch}" + (f", CUDA {first.cuda}" if first.cuda else "")
    same += f", NCCL {first.nccl}" if first.nccl else ""
    return Check("same versions", "ok", f"{same} on all {len(ranks)} ranks", "every rank runs the same builds")


# --- devices -------------------------------------------------------------------------------------


def check_gpus(names: Sequence[str], cuda_available: bool) -> Check:
    if not cuda_available or not names:
        return Check("gpus", "ok", "none (training runs on the CPU)", "no GPU visible to torch: training runs on the CPU")
    counts: dict[str, int] = {}
    for name in names:
        counts[name] = counts.get(name, 0) + 1
    return Check("gpus", "ok", ", ".join(f"{n} x {name}" for name, n in counts.items()), "GPUs torch sees on this host")


def check_topology(text: str | None, reason: str | None = None) -> Check:
    """`nvidia-smi topo -m`, shown as it is (how GPUs and NICs connect), not judged."""
    if text:
        return Check("topology", "ok", text.rstrip(), "nvidia-smi topo -m (NV#: NVLink, PIX/PXB: PCIe switch, SYS: across CPU sockets)")
    return Check("topology", "ok", "not shown" + (" (no nvidia-smi)" if reason is None or "not installed" in reason else ""), reason or "nvidia-smi is not installed: no GPU interconnect to show")


@dataclass(frozen=True)
class DeviceAssignment:
    """The GPU a rank uses by gradsync's rule (cuda:LOCAL_RANK), as that rank sees it."""

    rank: int
    host: str
    local_rank: int
    gpu_count: int
    gpu_name: str | None = None
    gpu_uuid: str | None = None  # identifies the physical GPU even when CUDA_VISIBLE_DEVICES renumbers


def check_device_assignment(ranks: Sequence[DeviceAssignment]) -> Check:
    hosts = {r.rank: r.host for r in ranks}
    with_gpu = [r for r in ranks if r.gpu_count > 0]
    if not with_gpu:
        return Check("device assignment", "ok", f"CPU on {'every rank' if len(ranks) > 1 else 'the rank'} (no GPU)", "no GPU: every rank runs on the CPU")
    findings, fixes = [], []
    without = [r.rank for r in ranks if r.gpu_count == 0]
    if without:
        findings.append(f"{_with_hosts(without, hosts)} see no GPU while the others do")
        fixes.append("give every host the same GPUs (CUDA_VISIBLE_DEVICES, the container's GPU request)")
    beyond = [r for r in with_gpu if r.local_rank >= r.gpu_count]
    for r in beyond:
        findings.append(f"rank {r.rank} ({r.host}) has LOCAL_RANK {r.local_rank} but sees only {r.gpu_count} GPU(s)")
    if beyond:
        most = min(r.gpu_count for r in beyond)
        fixes.append(f"start at most one process per GPU (--nproc-per-node {most}), and do not narrow "
                     "CUDA_VISIBLE_DEVICES per rank: gradsync uses cuda:LOCAL_RANK")
    by_gpu: dict[tuple[str, str], list[int]] = {}
    for r in with_gpu:
        if r.local_rank < r.gpu_count:
            key = (r.gpu_uuid, "") if r.gpu_uuid else (r.host, f"cuda:{r.local_rank}")
            by_gpu.setdefault(key, []).append(r.rank)
    shared = [rs for rs in by_gpu.values() if len(rs) > 1]
    for rs in shared:
        first = next(r for r in ranks if r.rank == rs[0])
        findings.append(f"{_with_hosts(rs, hosts)} share one GPU (cuda:{first.local_rank}, {first.gpu_name or 'GPU'})")
    if shared:
        fixes.append("give each rank its own GPU: set LOCAL_RANK per process (torchrun does) and do not set one "
                     "CUDA_VISIBLE_DEVICES for all ranks; NCCL fails with 'Duplicate GPU detected'")
    if findings:
        return Check("device assignment", "problem", f"{len(findings)} issue(s)", "; ".join(findings), "; ".join(fixes))
    names = sorted({r.gpu_name or "GPU" for r in with_gpu})
    return Check("device assignment", "ok", f"one GPU per rank on {len(with_gpu)} rank(s) (cuda:LOCAL_RANK)",
                 f"{', '.join(names)}; no GPU shared")


# --- environment variables -----------------------------------------------------------------------

ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_", "TORCHELASTIC_")
# Set by torchrun's agent in every worker: not the user's settings.
LAUNCHER_SET = frozenset({
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_SIGNALS_TO_HANDLE",
})
_NCCL_DISABLES = {
    "NCCL_P2P_DISABLE": ("GPU peer-to-peer transfers (NVLink, PCIe): traffic between GPUs of one host goes "
                         "through host memory, several times slower"),
    "NCCL_IB_DISABLE": "InfiniBand/RoCE: traffic between hosts falls back to TCP sockets, several times slower",
    "NCCL_SHM_DISABLE": "the shared-memory transport between processes of one host: it falls back to sockets",
}
_DEPRECATED = {
    "NCCL_BLOCKING_WAIT": "TORCH_NCCL_BLOCKING_WAIT",
    "NCCL_ASYNC_ERROR_HANDLING": "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "NCCL_DESYNC_DEBUG": "TORCH_NCCL_DESYNC_DEBUG",
}


def relevant_env(env: Mapping[str, str]) -> dict[str, str]:
    """The NCCL_*, GLOO_*, TORCH_* and TORCHELASTIC_* variables set, without torchrun's own.

    torchrun also sets TORCH_NCCL_ASYNC_ERROR_HANDLING=1 in every worker where it is unset: that
    default is left out too (a value the user chose is kept).
    """
    torchrun = "TORCHELASTIC_RUN_ID" in env
    return {
        k: env[k] for k in sorted(env)
        if k.startswith(ENV_PREFIXES) and k not in LAUNCHER_SET
        and not (torchrun and k == "TORCH_NCCL_ASYNC_ERROR_HANDLING" and env[k] == "1")
    }


def _is_nccl(name: str) -> bool:
    return name.startswith(("NCCL_", "TORCH_NCCL_"))


def _truthy(value: str) -> bool:
    try:
        return int(value.strip()) != 0
    except ValueError:
        return value.strip().lower() in ("true", "yes", "on")


def check_environment(env: Mapping[str, str], cuda: bool) -> list[Check]:
    """The variables that are set, and a line for each one that hurts.

    `cuda`: the rank has a usable GPU. Without one, NCCL settings do not apply and are not judged.
    """
    found = relevant_env(env)
    checks = [Check("environment", "ok", ", ".join(f"{k}={v}" for k, v in found.items()) or "none set",
                    "NCCL_*, GLOO_*, TORCH_*, TORCHELASTIC_* variables set (torchrun's own left out)")]
    for name, value in found.items():
        if cuda and name in _NCCL_DISABLES and _truthy(value):
            checks.append(Check(
                name, "warning", value, f"disables {_NCCL_DISABLES[name]} (performance)",
                f"unset {name} unless it works around a known hardware or driver fault; if it does, fix "
                "that fault (NCCL_DEBUG=WARN shows why NCCL fails without it)",
            ))
        elif cuda and name == "NCCL_DEBUG" and value.strip().upper() in ("INFO", "TRACE"):
            checks.append(Check(
                name, "warning", value, f"NCCL's {value.strip().upper()} logging left on: floods every rank's "
                "output at start-up and on every communicator (TRACE also slows collectives)",
                "unset NCCL_DEBUG (or NCCL_DEBUG=WARN) once the debugging is done",
            ))
        elif cuda and name in _DEPRECATED:
            checks.append(Check(
                name, "warning", value, f"deprecated name: torch reads {_DEPRECATED[name]} now and warns about this one",
                f"rename it: export {_DEPRECATED[name]}={value}; unset {name}",
            ))
        elif name == "TORCH_DISTRIBUTED_DEBUG" and value.strip().upper() == "DETAIL":
            checks.append(Check(
                name, "warning", value,
                "DETAIL is known to crash DDP scripts here (SIGSEGV right after DDP's reducer is built, healthy "
                "ones included; torch 2.13, CPU/Gloo); elsewhere it adds a check collective to every collective",
                "unset TORCH_DISTRIBUTED_DEBUG; to find mismatched or hanging collectives run the job under "
                "`gradsync run`, which records every rank's collectives and names the rank and line",
            ))
        elif name == "TORCH_DISTRIBUTED_DEBUG" and value.strip().upper() == "INFO":
            checks.append(Check(
                name, "warning", value, "debug mode left on: extra DDP checks and logs on every rank",
                "unset TORCH_DISTRIBUTED_DEBUG (or set it to OFF) for real runs; `gradsync run` diagnoses "
                "hangs without it",
            ))
        elif name == "TORCH_CPP_LOG_LEVEL" and value.strip().upper() in ("INFO", "0"):
            checks.append(Check(
                name, "warning", value, "torch's C++ INFO logging left on: every rank logs each process-group "
                "and store event",
                "unset TORCH_CPP_LOG_LEVEL (or set it to WARNING)",
            ))
    if cuda:
        checks.append(_check_nccl_error_handling(found))
    else:
        nccl = [k for k in found if _is_nccl(k)]
        checks.append(Check(
            "nccl settings", "ok", "do not apply (no GPU: Gloo)" + (f"; {', '.join(nccl)} set" if nccl else ""),
            "no GPU: collectives run on Gloo, so NCCL settings do not apply on this machine",
        ))
    return checks


def _check_nccl_error_handling(found: Mapping[str, str]) -> Check:
    handling = found.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", found.get("NCCL_ASYNC_ERROR_HANDLING"))
    blocking = found.get("TORCH_NCCL_BLOCKING_WAIT", found.get("NCCL_BLOCKING_WAIT"))
    shown = ", ".join(f"{k}={v}" for k, v in found.items()
                      if k.endswith(("ASYNC_ERROR_HANDLING", "BLOCKING_WAIT"))) or "default"
    if handling is not None and handling.strip() == "0" and not (blocking and _truthy(blocking)):
        return Check(
            "nccl error handling", "warning", shown,
            "NCCL errors and timeouts are not handled: after a rank dies, the others hang in their "
            "collective until something kills them",
            "unset TORCH_NCCL_ASYNC_ERROR_HANDLING (torch's default 3 ends the process on an error or "
            "timeout) or set it to 1; or TORCH_NCCL_BLOCKING_WAIT=1 to get the error raised in your code "
            "(every wait then blocks the CPU)",
        )
    return Check(
        "nccl error handling", "ok", shown,
        "a failed or timed-out NCCL collective ends the process instead of hanging (TORCH_NCCL_ASYNC_ERROR_"
        "HANDLING; TORCH_NCCL_BLOCKING_WAIT=1 raises it in your code instead)",
    )


# --- network -------------------------------------------------------------------------------------


def _addresses_text(name: str, interfaces: Mapping[str, Sequence[str]]) -> str:
    addrs = [a for a in interfaces.get(name, ()) if ":" not in a] or list(interfaces.get(name, ()))
    return f"{name} ({', '.join(addrs[:2])})" if addrs else name


def check_network_interface(
    env: Mapping[str, str],
    interfaces: Mapping[str, Sequence[str]],
    hostname_address: str | None,
    multi_host: bool,
    cuda: bool,
) -> list[Check]:
    """The interface Gloo (and NCCL on GPU hosts) would use to reach the other ranks.

    `interfaces` maps names to their addresses (psutil.net_if_addrs); `hostname_address` is what the
    hostname resolves to (None when it does not resolve); `multi_host`: ranks on several hosts.
    """
    names = ", ".join(sorted(interfaces)) or "none"
    checks = [_check_gloo_interface(env.get("GLOO_SOCKET_IFNAME"), interfaces, hostname_address, multi_host, names)]
    if cuda:
        checks.append(_check_nccl_interface(env.get("NCCL_SOCKET_IFNAME"), interfaces, multi_host, names))
    return checks


def _check_gloo_interface(
    setting: str | None, interfaces: Mapping[str, Sequence[str]], hostname_address: str | None,
    multi_host: bool, names: str,
) -> Check:
    if setting:
        wanted = [n.strip() for n in setting.split(",") if n.strip()]
        missing = [n for n in wanted if n not in interfaces]
        if missing:
            return Check(
                "gloo interface", "problem", f"GLOO_SOCKET_IFNAME={setting}",
                f"no interface {', '.join(missing)} on this host (it has: {names}): Gloo fails to create its "
                "device and the process group cannot start",
                "set GLOO_SOCKET_IFNAME to this host's interface on the network the other hosts reach "
                f"(one of: {names}), or unset it to use the hostname's address",
            )
        without = [n for n in wanted if not interfaces[n]]
        if without:
            return Check(
                "gloo interface", "problem", f"GLOO_SOCKET_IFNAME={setting}",
                f"{', '.join(without)} has no address: Gloo cannot bind to it",
                "bring the interface up with an address (`ip addr`), or point GLOO_SOCKET_IFNAME at one that has one",
            )
        loop = [n for n in wanted if all(is_loopback(a) for a in interfaces[n])]
        if loop and multi_host:
            return Check(
                "gloo interface", "problem", f"GLOO_SOCKET_IFNAME={setting}",
                f"{', '.join(loop)} is the loopback interface but the ranks span several hosts: the others cannot connect",
                f"set GLOO_SOCKET_IFNAME to the interface the other hosts reach (one of: {names})",
            )
        return Check("gloo interface", "ok",
                     ", ".join(_addresses_text(n, interfaces) for n in wanted) + ", from GLOO_SOCKET_IFNAME",
                     "the interface GLOO_SOCKET_IFNAME names exists and has an address")
    fix_unset = (f"set GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME on GPU hosts) to the interface the other hosts "
                 f"reach (one of: {names}), or map the hostname to that interface's address in /etc/hosts")
    if hostname_address is None:
        return Check(
            "gloo interface", "problem" if multi_host else "warning", "loopback (fallback)",
            "the hostname does not resolve, so Gloo falls back to the loopback interface"
            + (": ranks on other hosts cannot connect" if multi_host else " (enough on one host, with a warning)"),
            fix_unset,
        )
    interface = interface_of(hostname_address, interfaces)
    if interface is None:
        return Check(
            "gloo interface", "problem" if multi_host else "warning", f"hostname -> {hostname_address}",
            f"the hostname resolves to {hostname_address}, which no interface here holds: Gloo falls back to "
            "the loopback interface" + (" and ranks on other hosts cannot connect" if multi_host else ""),
            fix_unset,
        )
    if is_loopback(hostname_address) and multi_host:
        return Check(
            "gloo interface", "problem", f"{interface} ({hostname_address}), from the hostname",
            f"the hostname resolves to the loopback address {hostname_address} but the ranks span several "
            "hosts: the others cannot connect to this one",
            fix_unset,
        )
    note = "; loopback is enough on one host" if is_loopback(hostname_address) else ""
    return Check("gloo interface", "ok", f"{interface} ({hostname_address}), the hostname's address{note}",
                 "the interface holding the address the hostname resolves to (no GLOO_SOCKET_IFNAME)")


def _nccl_matches(setting: str, interfaces: Iterable[str]) -> list[str]:
    """NCCL_SOCKET_IFNAME semantics: prefixes, '^' excludes them, '=' asks for exact names."""
    spec = setting.strip()
    exclude = spec.startswith("^")
    spec = spec.lstrip("^")
    exact = spec.startswith("=")
    spec = spec.lstrip("=")
    parts = [p.strip() for p in spec.split(",") if p.strip()]

    def hit(name: str) -> bool:
        return any(name == p if exact else name.startswith(p) for p in parts)

    return [n for n in interfaces if hit(n) != exclude]


def _check_nccl_interface(
    setting: str | None, interfaces: Mapping[str, Sequence[str]], multi_host: bool, names: str
) -> Check:
    if setting:
        matched = [n for n in _nccl_matches(setting, sorted(interfaces)) if interfaces[n]]
        if not matched:
            return Check(
                "nccl interface", "problem", f"NCCL_SOCKET_IFNAME={setting}",
                f"{setting!r} matches no interface with an address on this host (it has: {names}): NCCL cannot "
                "bootstrap its connections",
                "set NCCL_SOCKET_IFNAME to this host's interface or a prefix of it (e.g. eth, ib0, "
                f"=eth0 for an exact name, ^docker,lo to exclude) among: {names}",
            )
        return Check("nccl interface", "ok", f"NCCL_SOCKET_IFNAME={setting}: {', '.join(matched)}",
                     "interfaces NCCL may use for its sockets")
    candidates = [n for n in _nccl_matches("^docker,lo,virbr", sorted(interfaces)) if interfaces[n]]
    if not candidates and multi_host:
        return Check(
            "nccl interface", "problem", "none",
            "no interface but loopback or docker ones: NCCL cannot reach the other hosts",
            "connect the host to the cluster network or set NCCL_SOCKET_IFNAME to the interface that reaches it",
        )
    return Check("nccl interface", "ok", "NCCL's choice among: " + (", ".join(candidates) or "lo"),
                 "NCCL picks InfiniBand first, then an interface that is not docker or loopback")


def check_hostname(hostname: str, address: str | None, error: str | None, multi_host: bool,
                   env: Mapping[str, str]) -> Check:
    if address is not None and is_loopback(address) and multi_host:
        return Check(
            "hostname", "warning", f"{hostname} -> {address} (loopback)",
            "the hostname resolves to a loopback address while the ranks span several hosts: whatever finds this "
            "host by its name (Gloo without GLOO_SOCKET_IFNAME, torchrun's c10d rendezvous) gets an address the "
            "others cannot reach",
            f"map {hostname} to this host's network address in /etc/hosts (not 127.0.1.1), or pin the interface "
            "(GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME) and give torchrun --local-addr <address>",
        )
    if address is not None:
        return Check("hostname", "ok", f"{hostname} -> {address}", "resolves (what Gloo and torchrun's c10d rendezvous use)")
    pinned = bool(env.get("GLOO_SOCKET_IFNAME"))
    return Check(
        "hostname", "problem" if multi_host and not pinned else "warning", f"{hostname}: does not resolve",
        f"socket.gethostbyname({hostname!r}) failed ({error}): Gloo falls back to loopback and torchrun's c10d "
        "rendezvous cannot advertise this host",
        f"add '<this host's address> {hostname}' to /etc/hosts (or DNS); or set GLOO_SOCKET_IFNAME/"
        "NCCL_SOCKET_IFNAME and pass torchrun --local-addr <address>",
    )


@dataclass(frozen=True)
class StoreProbe:
    """A TCP connect to MASTER_ADDR:MASTER_PORT (the launcher's store listens there)."""

    rank: int
    host: str
    address: str
    port: int
    reachable: bool
    seconds: float
    error: str | None = None


def check_store(probes: Sequence[StoreProbe], launched: bool) -> Check:
    if not launched:
        return Check("master address", "ok", "not probed (no launcher)", "a lone process: no store to reach")
    if not probes:
        return Check("master address", "ok", "not probed", "no rank probed the store")
    hosts = {p.rank: p.host for p in probes}
    target = f"{probes[0].address}:{probes[0].port}"
    failed = [p for p in probes if not p.reachable]
    if failed:
        errors = sorted({p.error or "no answer" for p in failed})
        return Check(
            "master address", "problem", target,
            f"{_with_hosts([p.rank for p in failed], hosts)} cannot connect to {target}: {'; '.join(errors)}",
            "MASTER_ADDR must be an address of the rank-0 host that every host reaches (not localhost on "
            "several hosts); open MASTER_PORT in the firewall; start the node-rank 0 launcher first",
        )
    slowest = max(p.seconds for p in probes)
    return Check("master address", "ok", f"{target} reachable", f"TCP connect from every rank, slowest {slowest * 1e3:.1f} ms")


@dataclass(frozen=True)
class AllReduceResult:
    backend: str
    world_size: int
    small_bytes: int
    small_s: float  # time of one small all-reduce: the latency
    large_bytes: int
    large_s: float
    busbw_gbps: float  # GB/s, nccl-tests' bus bandwidth of the large message


def _size(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB else f"{n // 1024} KiB" if n >= 1024 else f"{n} B"


def check_allreduce(result: AllReduceResult | None, reason: str | None = None) -> Check:
    """Shown, not judged: there is no right bandwidth without knowing the link."""
    if result is None:
        return Check("all-reduce", "ok", f"not measured ({reason or 'one rank'})", "nothing to reduce with")
    return Check(
        "all-reduce", "ok",
        f"busbw {result.busbw_gbps:.2f} GB/s ({result.busbw_gbps * 8:.1f} Gbit/s) at {_size(result.large_bytes)}; "
        f"{result.small_s * 1e6:.0f} us at {_size(result.small_bytes)}",
        f"{result.backend}, {result.world_size} ranks (busbw compares with the link's rate, as in nccl-tests)",
    )


@dataclass(frozen=True)
class PairResult:
    """A send/recv ping-pong between ranks a < b: `bytes` each way per round trip."""

    a: int
    b: int
    bytes: int
    round_trip_s: float

    @property
    def gbps(self) -> float:
        """GB/s moved one way (two messages per round trip, one after the other)."""
        return 2 * self.bytes / self.round_trip_s / 1e9


def slow_pairs(pairs: Sequence[PairResult], share: float = SLOW_PAIR_SHARE) -> tuple[float, list[PairResult]]:
    """(median GB/s, the pairs below `share` of it, slowest first)."""
    if not pairs:
        return 0.0, []
    median = statistics.median(p.gbps for p in pairs)
    return median, sorted((p for p in pairs if p.gbps < share * median), key=lambda p: p.gbps)


def check_pairs(pairs: Sequence[PairResult], hosts: Mapping[int, str], reason: str | None = None) -> Check:
    if not pairs:
        return Check("pairwise", "ok", f"not measured ({reason or 'one rank'})", "no pair to test")
    median, slow = slow_pairs(pairs)
    low = min(pairs, key=lambda p: p.gbps)
    size = _size(pairs[0].bytes)
    if not slow:
        if len(pairs) == 1:
            return Check("pairwise", "ok", f"{low.a}<->{low.b}: {low.gbps:.2f} GB/s",
                         f"send/recv ping-pong of {size}; one pair, nothing to compare with")
        return Check("pairwise", "ok", f"{len(pairs)} pairs, slowest {low.a}<->{low.b} {low.gbps:.2f} GB/s, "
                     f"median {median:.2f} GB/s", f"send/recv ping-pong of {size}; no pair below half the median")
    named = ", ".join(
        f"{p.a}<->{p.b} ({hosts.get(p.a, '?')}<->{hosts.get(p.b, '?')}) {p.gbps:.3f} GB/s" for p in slow[:6]
    ) + (f" and {len(slow) - 6} more" if len(slow) > 6 else "")
    in_all = sorted(set.intersection(*({p.a, p.b} for p in slow)))
    common = (f"; {_with_hosts(in_all, hosts)} in every slow pair" if in_all and len(slow) > 1 else "")
    return Check(
        "pairwise", "warning", f"{len(slow)} slow pair(s) of {len(pairs)}, median {median:.2f} GB/s",
        f"below half the median pair: {named}{common}",
        "look at the link of the host(s) named: a NIC that negotiated a lower speed (`ethtool <iface>`), "
        "errors or drops (`ip -s link`), a different switch or route, or GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME "
        "pointing at a slower interface on that host",
    )


# --- host limits ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class DiskSpace:
    total: int
    free: int  # available to an unprivileged user (f_bavail)

    @classmethod
    def from_statvfs(cls, st: Any) -> DiskSpace:
        """From os.statvfs's result (or anything with its f_frsize, f_blocks and f_bavail)."""
        frsize = st.f_frsize or st.f_bsize
        return cls(total=st.f_blocks * frsize, free=st.f_bavail * frsize)


def _bytes(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / MIB:.0f} MiB"


def check_shm(path: str, space: DiskSpace | None, cuda: bool) -> Check:
    fix = ("give the container more shared memory: `docker run --shm-size=8g` (or `--ipc=host`); in Kubernetes "
           f"mount an emptyDir with `medium: Memory` at {path}")
    if space is None:
        fix = f"mount a tmpfs at {path} (`mount -t tmpfs -o size=8g tmpfs {path}`; Docker: --shm-size=8g)"
        return Check(
            "shared memory", "problem" if cuda else "warning", f"{path}: missing",
            f"{path} does not exist: " + ("NCCL needs it for transfers between processes of one host"
                                          if cuda else "DataLoader workers pass batches through it"),
            fix,
        )
    value = f"{path}: {_bytes(space.total)} ({_bytes(space.free)} free)"
    if space.total < SHM_MIN_BYTES:
        if cuda:
            return Check("shared memory", "problem", value,
                         f"under {_bytes(SHM_MIN_BYTES)} (Docker's default is 64 MiB): NCCL fails with "
                         "'unhandled system error' / 'No space left on device' once GPUs of one host talk", fix)
        return Check("shared memory", "warning", value,
                     f"under {_bytes(SHM_MIN_BYTES)}: DataLoader workers (num_workers > 0) pass batches through it "
                     "and die with 'Bus error' when it fills", fix)
    return Check("shared memory", "ok", value, f"at least {_bytes(SHM_MIN_BYTES)}")


def check_open_files(soft: int, hard: int) -> Check:
    def text(n: int) -> str:
        return "unlimited" if n < 0 else str(n)

    value = f"{text(soft)} (hard limit {text(hard)})"
    if 0 <= soft < NOFILE_MIN:
        if hard < 0 or hard >= NOFILE_MIN:
            fix = f"`ulimit -n {hard if 0 <= hard < 65536 else 65536}` in the job script before launching"
        else:
            fix = (f"the hard limit is {hard}: raise it (container: `--ulimit nofile=65536:65536`; host: "
                   "/etc/security/limits.conf), then `ulimit -n 65536` before launching")
        return Check("open files", "warning", value,
                     f"under {NOFILE_MIN}: sockets to every peer and DataLoader descriptors run out on large jobs "
                     "('Too many open files')", fix)
    return Check("open files", "ok", value, f"RLIMIT_NOFILE at least {NOFILE_MIN}")


def check_checkpoint_disk(path: str, space: DiskSpace | None, writable: bool, existing: str | None = None) -> Check:
    """Free space where checkpoints go. `existing`: the nearest existing folder when `path` is not there yet."""
    where = path if existing is None or existing == path else f"{path} (to be created in {existing})"
    if space is None:
        return Check("checkpoint disk", "problem", f"{where}: unreadable", "cannot stat the folder or any parent",
                     "pass --checkpoint-dir with a folder on a mounted, readable filesystem")
    value = f"{_bytes(space.free)} free of {_bytes(space.total)} at {where}"
    if not writable:
        return Check("checkpoint disk", "problem", value, "not writable by this user: saving a checkpoint would fail",
                     "choose a folder this user can write (checkpoint.dir), or fix its permissions")
    if space.free < DISK_PROBLEM_BYTES:
        verdict: Verdict = "problem"
    elif space.free < DISK_WARN_BYTES:
        verdict = "warning"
    else:
        return Check("checkpoint disk", "ok", value, f"at least {_bytes(DISK_WARN_BYTES)} free")
    return Check(
        "checkpoint disk", verdict, value,
        f"under {_bytes(DISK_WARN_BYTES if verdict == 'warning' else DISK_PROBLEM_BYTES)} free: "
        "checkpoints of a model trained with Adam take 12-16 bytes per parameter, and gradsync keeps 3 "
        "plus the one being written",
        "free space there, or point checkpoint.dir (--checkpoint-dir) at a larger filesystem; fewer kept "
        "checkpoints (checkpoint.keep) need less",
    )
