"""What the machine under one rank is doing: CPU, memory, network and GPU, sampled in the background.

A starved GPU, a rank swapping or a saturated link explain a slow step better than the step time
does. The sampler runs on its own thread, wakes once per interval, and keeps running means
that the metrics recorder takes at each gather, so training pays nothing per step: measured
here, one sample costs ~0.1 ms of CPU (psutil reads of /proc), 0.01% of a core at one sample a
second.

- CPU and memory: this process's CPU use (100 = one core busy) and resident memory (psutil).
- Network: bytes per second sent and received on the interface the backend talks through
  (`GLOO_SOCKET_IFNAME` / `NCCL_SOCKET_IFNAME` when set, else the one that reaches the master
  address), so the figure is the job's traffic, not the whole host's.
- GPU, where NVML is there (the optional `nvidia-ml-py`): utilisation, memory used,
  temperature, power and SM clock of this rank's device. Without it the GPU keys are absent.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import psutil



class _Gpu:
    """NVML readings of one device; `open` returns None when NVML or the device is unavailable."""

    def __init__(self, nvml: Any, handle: Any):
        self.nvml = nvml
        self.handle = handle

    @classmethod
    def open(cls, uuid: str | None) -> "_Gpu | None":
        """The device whose UUID CUDA reports (`torch.cuda.get_device_properties(d).uuid`).

        Not its index: NVML numbers every GPU of the host in PCI order, while a CUDA index
        counts only the GPUs CUDA_VISIBLE_DEVICES leaves, fastest first by default. NVML
        prefixes the UUID with "GPU-", or "MIG-" for a MIG instance.
        """
        if uuid is None:
            return None
        try:
            import pynvml  # nvidia-ml-py, optional

            pynvml.nvmlInit()
        except Exception:  # no package, no driver: GPU metrics are simply absent
            return None
        for name in (f"GPU-{uuid}", f"MIG-{uuid}"):
            try:
                return cls(pynvml, pynvml.nvmlDeviceGetHandleByUUID(name))
            except Exception:  # not a GPU (or MIG instance) NVML knows by that name
                continue
        return None

    def read(self) -> dict[str, float]:
        nvml, handle = self.nvml, self.handle
        readings: dict[str, Callable[[], float]] = {
            "gpu_util_percent": lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu,
            "gpu_memory_mb": lambda: nvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20,
            "gpu_temperature_c": lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU),
            "gpu_power_w": lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000,
            "gpu_sm_clock_mhz": lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM),
        }
        values = {}
        for key, read in readings.items():
            try:
                values[key] = float(read())
            except Exception:  # a reading this device or driver does not support
                continue
        return values


class SystemSampler:
    """Samples this rank's system metrics every `interval_s` on a daemon thread.

    `take()` returns the means since the previous `take()` and starts a new interval; it is
    called by the training thread at each metrics gather. The lock keeps a reading and the
    running sums whole between the two threads.
    """

    def __init__(self, interval_s: float, interface: str | None = None, gpu_uuid: str | None = None):
        self.interval_s = interval_s
        self.interface = interface
        self._process = psutil.Process()
        self._gpu = _Gpu.open(gpu_uuid)
        self._lock = threading.Lock()
        self._sums: dict[str, float] = {}
        self._samples = 0
        self._stopped = threading.Event()
        self._process.cpu_percent(None)  # the first call only starts psutil's measuring interval
        self._last_net = self._net_bytes()
        self._last_time = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="gradsync-system-metrics", daemon=True)

    def start(self) -> "SystemSampler":
        self._thread.start()
        return self

    def _net_bytes(self) -> tuple[int, int] | None:
        counters = psutil.net_io_counters(pernic=True)
        if self.interface is not None:
            nic = counters.get(self.interface)
            return None if nic is None else (nic.bytes_sent, nic.bytes_recv)
        # Unknown interface: every one but loopback, i.e. the host's external traffic.
        nics = [c for name, c in counters.items() if name != "lo"]
        return (sum(c.bytes_sent for c in nics), sum(c.bytes_recv for c in nics))

    def sample(self) -> dict[str, float]:
        """One reading of every metric (rates over the time since the previous reading)."""
        now = time.monotonic()
        values = {
            "cpu_percent": self._process.cpu_percent(None),
            "rss_mb": self._process.memory_info().rss / 2**20,
        }
        net = self._net_bytes()
        elapsed = now - self._last_time
        if net is not None and self._last_net is not None and elapsed > 0:
            values["net_sent_mbps"] = (net[0] - self._last_net[0]) * 8 / elapsed / 1e6
            values["net_recv_mbps"] = (net[1] - self._last_net[1]) * 8 / elapsed / 1e6
        self._last_net, self._last_time = net, now
        if self._gpu is not None:
            values.update(self._gpu.read())
        return values

    def _add_sample(self) -> None:
        try:
            values = self.sample()
        except (psutil.Error, OSError):
            return  # a transient /proc read failure must not end the sampling
        for key, value in values.items():
            self._sums[key] = self._sums.get(key, 0.0) + value
        self._samples += 1

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            with self._lock:
                self._add_sample()

    def take(self) -> dict[str, float]:
        """Means over the samples since the last call.

        An interval shorter than the sampling period gets one reading taken now, so every
        gather carries every rank's figures (~0.1 ms on the training thread, once per gather).
        """
        with self._lock:
            if not self._samples:
                self._add_sample()
            sums, samples = self._sums, self._samples
            self._sums, self._samples = {}, 0
        return {key: total / samples for key, total in sums.items()} if samples else {}

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.interval_s + 1)
