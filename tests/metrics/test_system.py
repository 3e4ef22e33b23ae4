"""The background system sampler: what it reads, on which interface, and its means per interval."""

import socket
import threading
import time

import pytest

from gradsync.metrics.config import MetricsConfig
from gradsync.errors import ConfigError
from gradsync.metrics.system import SystemSampler
from gradsync.netif import backend_interface


def test_the_backend_interface_is_the_configured_one_or_the_one_reaching_the_master():
    assert backend_interface({"GLOO_SOCKET_IFNAME": "eth7,eth8"}) == "eth7"
    assert backend_interface({"NCCL_SOCKET_IFNAME": "ib0"}) == "ib0"
    # NCCL's exclusion syntax names no interface: fall back to the route to the master.
    assert backend_interface({"NCCL_SOCKET_IFNAME": "^docker", "MASTER_ADDR": "127.0.0.1"}) == "lo"
    assert backend_interface({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}) == "lo"
    assert backend_interface({}) is None


def _busy(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
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


def test_means_per_interval_of_cpu_memory_and_loopback_traffic():
    sampler = SystemSampler(0.02, interface="lo").start()
    try:
        sampler.take()  # whatever came before this interval is discarded
        wall, cpu = time.perf_counter(), time.process_time()
        _busy(0.3)
        share = (time.process_time() - cpu) / (time.perf_counter() - wall) * 100  # of one core, as the OS gave it
        busy = sampler.take()
        # The share a busy loop gets depends on the machine's other load (tests run two at a time):
        # the sampler must see about what the process itself measured.
        assert share > 5 and busy["cpu_percent"] > 0.5 * share, (busy, share)
        assert busy["rss_mb"] > 50
        assert _send_over_loopback(64) == 64 << 20
        time.sleep(0.05)
        sent = sampler.take()
        assert sent["net_sent_mbps"] > 0 and sent["net_recv_mbps"] > 0, sent
        assert not any(key.startswith("gpu_") for key in sent), "no NVML here: GPU keys are absent"
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
