"""traceml.capture.telemetry with fakes (no GPU in CI): host CPU rates, the allocator and NVML
readers, the sampler's queue, and its fail-open behaviour."""

from __future__ import annotations

from collections import namedtuple
from types import SimpleNamespace

import pytest

from traceml import schema
from traceml.capture import guard, telemetry

CpuTimes = namedtuple("CpuTimes", "user system")
SystemTimes = namedtuple("SystemTimes", "user nice system idle iowait irq softirq")


class FakePsutil:
    """psutil's surface HostProbe uses; the test moves the counters."""

    Error = OSError

    def __init__(self) -> None:
        self.mine = CpuTimes(10.0, 2.0)
        self.children = {101: CpuTimes(1.0, 0.0)}
        self.system = SystemTimes(100.0, 0.0, 50.0, 800.0, 0.0, 0.0, 0.0)
        self.available = 6 * 2**30

    def Process(self, pid: int | None = None):
        if pid is None:
            return SimpleNamespace(cpu_times=lambda: self.mine, children=lambda: [])
        if pid not in self.children:
            raise OSError("gone")
        return SimpleNamespace(cpu_times=lambda: self.children[pid])

    def cpu_count(self) -> int:
        return 4

    def cpu_times(self) -> SystemTimes:
        return self.system

    def virtual_memory(self):
        return SimpleNamespace(available=self.available, total=8 * 2**30)


def test_host_probe_rates_between_reads() -> None:
    fake = FakePsutil()
    probe = telemetry.HostProbe(fake, children=lambda: list(fake.children))
    first = probe.read(100.0)
    assert first[schema.CPU_PROCESS_PCT] is None and first[schema.WORKER_PROCESSES] == 1
    assert first[schema.HOST_MEM_TOTAL] == 8 * 2**30
    fake.mine = CpuTimes(10.5, 2.0)  # 0.5 s of CPU in 2 s: 25% of a core
    fake.children = {101: CpuTimes(2.5, 0.5)}  # the worker: 2 s in 2 s
    fake.system = SystemTimes(105.0, 0.0, 51.0, 802.0, 0.0, 0.0, 0.0)  # 6 busy of 8
    second = probe.read(102.0)
    assert second[schema.CPU_PROCESS_PCT] == pytest.approx(25.0)
    assert second[schema.CPU_WORKERS_PCT] == pytest.approx(100.0)
    assert second[schema.CPU_SYSTEM_PCT] == pytest.approx(75.0)
    # A new worker brings its whole past CPU time: no worker rate for that interval.
    fake.children[102] = CpuTimes(50.0, 0.0)
    assert probe.read(103.0)[schema.CPU_WORKERS_PCT] is None


def test_cuda_probe_reads_allocator_counters_and_nvml() -> None:
    stats = {
        "allocated_bytes.all.current": 3 * 2**30,
        "reserved_bytes.all.current": 4 * 2**30,
        "num_alloc_retries": 2,
        "num_ooms": 0,
    }

    class FakeNvml:
        NVML_TEMPERATURE_GPU = 0

        def nvmlInit(self) -> None:
            pass

        def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
            assert uuid == "GPU-abc"
            return "handle"

        def nvmlDeviceGetUtilizationRates(self, handle: str):
            return SimpleNamespace(gpu=37, memory=10)

        def nvmlDeviceGetTemperature(self, handle: str, sensor: int) -> int:
            return 61

        def nvmlDeviceGetPowerUsage(self, handle: str) -> int:
            return 250_000  # milliwatts

    nvml = telemetry.nvml_probe(0, "abc", pynvml=FakeNvml())
    sample = telemetry.CudaProbe(lambda: stats, nvml).read()
    assert sample[schema.DEVICE_MEM_ALLOCATED] == 3 * 2**30
    assert sample[schema.ALLOC_RETRIES] == 2 and sample[schema.DEVICE_OOMS] == 0
    assert sample[schema.NVML_GPU_UTIL_PCT] == 37.0
    assert sample[schema.NVML_TEMPERATURE_C] == 61.0 and sample[schema.NVML_POWER_W] == 250.0


def test_nvml_is_optional() -> None:
    class Broken:
        def nvmlInit(self) -> None:
            raise RuntimeError("NVML Shared Library Not Found")

    assert telemetry.nvml_probe(0, None, pynvml=Broken()) is None

    class FailsLater:
        def read(self) -> dict:
            raise RuntimeError("GPU is lost")

    probe = telemetry.CudaProbe(lambda: {}, FailsLater())
    assert schema.NVML_GPU_UTIL_PCT not in probe.read()
    assert probe.nvml is None  # left alone after one failure


class CountingHost:
    def __init__(self, fail: bool = False) -> None:
        self.reads = 0
        self.fail = fail

    def read(self, now_s: float) -> dict:
        self.reads += 1
        if self.fail:
            raise OSError("procfs gone")
        return {schema.CPU_SYSTEM_PCT: 50.0}


def test_sampler_queues_samples_and_stops() -> None:
    host = CountingHost()
    sampler = telemetry.TelemetrySampler(origin_ns=0, host=host, interval_s=0.01)
    sampler.start()
    assert sampler._thread.daemon
    deadline = telemetry.clock_ns() + 5_000_000_000
    while host.reads < 3 and telemetry.clock_ns() < deadline:
        sampler._stop.wait(0.01)
    taken = list(sampler.collect()) + list(sampler.stop())
    assert not sampler._thread.is_alive()
    assert len(taken) >= 3
    assert all(
        s[schema.KIND] == schema.KIND_SAMPLE and s[schema.CPU_SYSTEM_PCT] == 50.0 for s in taken
    )
    assert taken[-1][schema.TELEMETRY_CPU_US] >= taken[0][schema.TELEMETRY_CPU_US] > 0
    assert sampler.off is None


def test_failing_samples_turn_telemetry_off_not_training() -> None:
    sampler = telemetry.TelemetrySampler(
        origin_ns=0, host=CountingHost(fail=True), interval_s=0.001
    )
    sampler.start()  # the first sample fails quietly; the thread keeps trying
    sampler._thread.join(timeout=5)
    assert not sampler._thread.is_alive()
    assert sampler.off is not None and "in a row failed" in sampler.off
    assert sampler.stop() == []


def test_entry_points_are_guarded(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("telemetry.start", "telemetry.collect", "telemetry.stop"):
        assert name in guard.ENTRY_POINTS
    monkeypatch.setattr(guard, "_inject", "telemetry.collect")
    sampler = telemetry.TelemetrySampler(origin_ns=0, host=CountingHost(), interval_s=60)
    sampler.pending.append({"kind": "sample"})
    assert sampler.collect() == ()  # the default, not an exception
    assert sampler.off is not None and "telemetry.collect" in sampler.off
    assert sampler._stop.is_set()


class HungHost:
    """A probe whose read never returns (an NVML call stuck in the driver)."""

    def __init__(self) -> None:
        import threading

        self.reads = 0
        self.stuck = threading.Event()
        self.release = threading.Event()

    def read(self, now_s: float) -> dict:
        self.reads += 1
        if self.reads > 1:  # the thread's first sample: stuck until the test ends
            self.stuck.set()
            self.release.wait()
        return {}


def test_stop_never_hangs_behind_a_hung_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    monkeypatch.setattr(telemetry, "STOP_WAIT_S", 0.2)
    host = HungHost()
    sampler = telemetry.TelemetrySampler(origin_ns=0, host=host, interval_s=0.01)
    sampler.start()  # the baseline sample returns; the thread's next one hangs
    assert host.stuck.wait(10)
    stopper = threading.Thread(target=sampler.stop, daemon=True)
    stopper.start()
    stopper.join(timeout=10)
    hung = stopper.is_alive()
    host.release.set()
    assert not hung, "telemetry.stop() hung behind a sample that never returns"
