"""Network interfaces: which ones this host has, and which one the process group's traffic takes.

Shared by the system metrics (the traffic on the backend's interface) and the doctor (is the
interface Gloo or NCCL would pick one that reaches the other hosts?).
"""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path
from typing import Mapping, Sequence


def is_loopback(address: str) -> bool:
    """127.x, ::1 (a scope suffix like %lo ignored); False for what is not an address."""
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def interface_of(address: str, interfaces: Mapping[str, Sequence[str]]) -> str | None:
    """The interface holding `address` (any 127.x address is the loopback interface's)."""
    for name, addresses in interfaces.items():
        if address in addresses:
            return name
    if is_loopback(address):
        return next((n for n, addrs in interfaces.items() if any(is_loopback(a) for a in addrs)), "lo")
    return None


def network_interfaces() -> dict[str, list[str]]:
    """Interface name -> its IPv4 and IPv6 addresses (psutil.net_if_addrs, or the stdlib on Linux)."""
    try:
        import psutil
    except ImportError:
        return _stdlib_interfaces()
    result: dict[str, list[str]] = {}
    for name, addresses in psutil.net_if_addrs().items():
        result[name] = [a.address.split("%")[0] for a in addresses if a.family in (socket.AF_INET, socket.AF_INET6)]
    return result


def _stdlib_interfaces() -> dict[str, list[str]]:
    """Without psutil: names from if_nameindex, IPv4 by SIOCGIFADDR, IPv6 from /proc/net/if_inet6."""
    import fcntl
    import struct

    result: dict[str, list[str]] = {name: [] for _, name in socket.if_nameindex()}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for name, addresses in result.items():
            try:
                packed = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
                addresses.append(socket.inet_ntoa(packed[20:24]))
            except OSError:
                pass
    try:
        for line in Path("/proc/net/if_inet6").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 6 and parts[5] in result:
                result[parts[5]].append(str(ipaddress.IPv6Address(bytes.fromhex(parts[0]))))
    except OSError:
        pass
    return result


def backend_interface(env: dict[str, str] | None = None) -> str | None:
    """The network interface the process group's traffic goes through, or None if unknown."""
    env = os.environ if env is None else env
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        setting = env.get(variable, "").strip()
        if setting and not setting.startswith(("^", "=")):  # a plain name, not NCCL's exclusion syntax
            return setting.split(",")[0]
    master = env.get("MASTER_ADDR")
    if not master:
        return None
    try:
        # A UDP "connect" sends nothing; it only asks the kernel which local address routes there.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(master), int(env.get("MASTER_PORT", "29500"))))
            local = probe.getsockname()[0]
    except (OSError, ValueError):
        return None
    return interface_of(local, network_interfaces())
