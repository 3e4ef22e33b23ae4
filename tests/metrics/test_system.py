"""The background system sampler: what it reads, on which interface, and its means per interval."""

import os
import socket
import threading
import time
from types import SimpleNamespace

import pytest

from gradsync.metrics.config import MetricsConfig
from gradsync.errors import ConfigError
from gradsync.metrics import system
from gradsync.metrics.system import SystemSampler
from gradsync.netif import backend_interface


def test_the_backend_interface_is_the_configured_one_or_the_one_reaching_the_master():
    assert backend_interface({"GLOO_SOCKET_IFNAME": "eth7,eth8"}) == "eth7"
    assert backend_interface({"NCCL_SOCKET_IFNAME": "ib0"}) == "ib0"
    # NCCL's exclusion syntax names no interface: fall back to the route to the master.
    assert backend_interface({"NCCL_SOCKET_IFNAME": "^docker", "MASTER_ADDR": "127.0.0.1"}) == "lo"
    assert backend_interface({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}) == "lo"
    assert backend_interface({}) is None


def _burn_cpu(seconds):
    """Spend `seconds` of this process's CPU time, however long the machine takes to give it."""
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def _send_over_loopback(megabytes):
    server = socket.create_server(("127.0.0.1", 0))
    received = []

    def drain():
        connection, _ = server.accept()
        with connection:
            while chunk := connection.recv(1 << 20):
                received.append(len(chunk))

    reader = threading.Thread(target=drain)
    reader.start()
    with socket.create_connection(server.getsockname()) as client:
        client.sendall(b"\0" * (megabytes << 20))
    reader.join()
    server.close()
    return sum(received)


# psutil reads a process's CPU time in clock ticks, user and system time each cut to a whole
# tick, and rounds its percentage to 0.1: a reading is off by up to two ticks, three to be safe.
TICKS_S = 3 / os.sysconf("SC_CLK_TCK")


def test_one_reading_gives_the_cpu_and_traffic_of_its_interval():
    # The interval is bracketed from inside and outside by this test's own clocks, so the bounds
    # hold however busy the machine is: it only stretches the interval, never the work in it.
    sampler = SystemSampler(60.0, interface="lo")  # not started: the readings are this test's
    outer_wall, outer_cpu = time.monotonic(), time.process_time()
    sampler.sample()  # starts the interval
    inner_wall, inner_cpu = time.monotonic(), time.process_time()
    _burn_cpu(0.2)
    assert _send_over_loopback(64) == 64 << 20
    inner_cpu, inner_wall = time.process_time() - inner_cpu, time.monotonic() - inner_wall
    reading = sampler.sample()
    outer_cpu, outer_wall = time.process_time() - outer_cpu, time.monotonic() - outer_wall
    used_s = reading["cpu_percent"] / 100
    assert (inner_cpu - TICKS_S) / outer_wall <= used_s <= (outer_cpu + TICKS_S) / inner_wall, (reading, inner_cpu, outer_wall)
    # Loopback counts our 64 MiB each way, and whatever else used it meanwhile.
    least_mbps = (64 << 20) * 8 / outer_wall / 1e6
    assert reading["net_sent_mbps"] >= least_mbps and reading["net_recv_mbps"] >= least_mbps, (reading, least_mbps)
    assert reading["rss_mb"] > 50
    assert not any(key.startswith("gpu_") for key in reading), "no NVML here: GPU keys are absent"


class _Readings:
    """psutil.Process's two calls the sampler makes, answering from a script."""

    def __init__(self, cpu_percent, rss_mb):
        self._cpu, self._rss = iter(cpu_percent), iter(rss_mb)

    def cpu_percent(self, interval):
        return next(self._cpu)

    def memory_info(self):
        return type("Memory", (), {"rss": next(self._rss) * 2**20})()


def test_take_gives_the_means_of_the_readings_since_the_last_take(monkeypatch):
    sent = iter([1000, 3000, 5000, 6000, 6000])  # bytes, one count per reading (the first: at construction)
    monkeypatch.setattr(system.psutil, "net_io_counters", lambda pernic: {"lo": _Nic(next(sent))})
    clock = iter([0.0, 1.0, 2.0, 3.0, 5.0])
    monkeypatch.setattr(system, "time", SimpleNamespace(monotonic=lambda: next(clock)))
    sampler = SystemSampler(60.0, interface="lo")  # not started: each reading is taken below
    sampler._process = _Readings(cpu_percent=[50.0, 70.0, 90.0, 20.0], rss_mb=[100.0, 200.0, 300.0, 400.0])
    sampler._add_sample()
    sampler._add_sample()
    first = sampler.take()
    assert first == {"cpu_percent": 60.0, "rss_mb": 150.0, "net_sent_mbps": 2000 * 8 / 1e6, "net_recv_mbps": 0.0}
    sampler._add_sample()
    assert sampler.take() == {"cpu_percent": 90.0, "rss_mb": 300.0, "net_sent_mbps": 1000 * 8 / 1e6, "net_recv_mbps": 0.0}
    # Nothing sampled since: take() reads once itself, so every gather carries figures.
    assert sampler.take() == {"cpu_percent": 20.0, "rss_mb": 400.0, "net_sent_mbps": 0.0, "net_recv_mbps": 0.0}


class _Nic:
    def __init__(self, bytes_sent):
        self.bytes_sent, self.bytes_recv = bytes_sent, 0


def test_the_sampler_thread_reads_until_stopped():
    sampler = SystemSampler(0.01, interface="lo").start()
    try:
        # Waits for the thread's readings (any count will do) instead of sleeping a guessed time.
        while not sampler._samples:
            time.sleep(0.01)
        assert sampler.take()["rss_mb"] > 50
    finally:
        sampler.stop()
    assert not sampler._thread.is_alive()


def test_an_unknown_interface_gives_no_network_rates_but_everything_else():
    sampler = SystemSampler(0.02, interface="no-such-nic")
    values = sampler.sample()
    assert "net_sent_mbps" not in values and values["rss_mb"] > 0


@pytest.mark.parametrize("every", [0, 0.01, -1, True, "1s"])
def test_a_bad_sampling_interval_is_refused(every):
    with pytest.raises(ConfigError, match="system_every_s"):
        MetricsConfig(system_every_s=every)


def test_system_sampling_can_be_turned_off():
    assert MetricsConfig(system_every_s=None).system_every_s is None


class _FakeNvml:
    """NVML's Python binding as nvidia-ml-py exposes it, with one device's readings (no GPU here)."""

    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1

    def __init__(self):
        self.initialised = False

    def nvmlInit(self):
        self.initialised = True

    # NVML's numbering of the host's GPUs (PCI order), which CUDA_VISIBLE_DEVICES does not change:
    # with CUDA_VISIBLE_DEVICES=3, this rank's cuda:0 is NVML's device 3.
    UUIDS = {0: "GPU-aaaaaaaa-0000-0000-0000-000000000000", 3: "GPU-dddddddd-0000-0000-0000-000000000003",
             4: "MIG-eeeeeeee-0000-0000-0000-000000000004"}

    def nvmlDeviceGetHandleByIndex(self, index):
        if index not in self.UUIDS:
            raise RuntimeError("NVML_ERROR_INVALID_ARGUMENT")
        return f"device-{index}"

    def nvmlDeviceGetHandleByUUID(self, uuid):
        for index, known in self.UUIDS.items():
            if known == uuid:
                return f"device-{index}"
        raise RuntimeError("NVML_ERROR_NOT_FOUND")

    def nvmlDeviceGetUtilizationRates(self, handle):
        return type("Rates", (), {"gpu": 87 if handle == "device-3" else 5})()

    def nvmlDeviceGetMemoryInfo(self, handle):
        return type("Memory", (), {"used": 3 * 2**30})()

    def nvmlDeviceGetTemperature(self, handle, sensor):
        return 71

    def nvmlDeviceGetPowerUsage(self, handle):
        return 312_500  # milliwatts

    def nvmlDeviceGetClockInfo(self, handle, clock):
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")  # some boards do not report it


def test_gpu_readings_come_from_nvml_for_this_ranks_device(monkeypatch):
    import sys

    fake = _FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    # CUDA's UUID of the rank's device (cuda:0 under CUDA_VISIBLE_DEVICES=3), without NVML's "GPU-".
    sampler = SystemSampler(1.0, interface="lo", gpu_uuid="dddddddd-0000-0000-0000-000000000003")
    values = sampler.sample()
    assert fake.initialised
    assert (values["gpu_util_percent"], values["gpu_memory_mb"], values["gpu_temperature_c"], values["gpu_power_w"]) == (87, 3072, 71, 312.5)
    assert "gpu_sm_clock_mhz" not in values, "a reading the board does not support is left out, the rest kept"
    mig = SystemSampler(1.0, interface="lo", gpu_uuid="eeeeeeee-0000-0000-0000-000000000004").sample()
    assert mig["gpu_util_percent"] == 5, "a MIG instance is found by NVML's MIG- name"
    # A device NVML does not know, or no NVML at all: no GPU keys, nothing raised.
    assert not any(k.startswith("gpu_") for k in SystemSampler(1.0, gpu_uuid="ffffffff-0000-0000-0000-000000000000").sample())
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert not any(k.startswith("gpu_") for k in SystemSampler(1.0, gpu_uuid="dddddddd-0000-0000-0000-000000000003").sample())
