"""Low-rate telemetry: host CPU and memory, the allocator's counters, NVML, about once a second.

One daemon thread per traced rank takes a sample every ``SAMPLE_INTERVAL_S``. It never writes:
samples wait in a short queue, and the callback writes them through the rank's recorder when
it writes its next step record (so the rank file has one writer, and samples are as crash-safe
as steps). Why a thread in each rank rather than one in the launcher: a rank knows its own
process tree (DataLoader workers are its children) and its own device, and a direct launch
(``TRACEML=1 python train.py``, torchrun) has no traceml launcher at all.

Measured cost (benchmarks/telemetry.py, 2-core VM): one sample takes ~0.1-0.3 ms of CPU
(psutil reads of /proc/self, /proc/stat and /proc/meminfo, one per worker); at 1 Hz that is
~0.02% of one core. Workers are found through /proc/self/task/*/children (~10 us), not
psutil's ``children()``, which scans every process on the machine (~0.8 ms with 80 of them).

Fail-open: the loop catches everything; after ``MAX_FAILURES`` failed samples in a row the
thread stops and says so once. The calls the callback makes (start, collect, stop) are guarded
entry points owned by the sampler: a failure there turns telemetry off, not step tracing.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from traceml import console, schema
from traceml.capture.clock import clock_ns
from traceml.capture.guard import entry_point

SAMPLE_INTERVAL_S = 1.0
MAX_FAILURES = 3
# Samples waiting for the next step record; a long pause between steps (a validation of an
# hour) keeps only the most recent ones.
QUEUE_LENGTH = 600


def _proc_children() -> list[int] | None:
    """This process's direct children, from /proc (None where it cannot be read)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    pids: list[int] = []
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/children", "rb") as handle:
                pids.extend(int(pid) for pid in handle.read().split())
        except (OSError, ValueError):
            continue
    return pids


class HostProbe:
    """Process CPU (this process and its children, the DataLoader workers), system CPU and
    host memory. CPU figures are rates between two reads: the first read has none."""

    def __init__(self, psutil_module: Any = None, children: Callable[[], Any] | None = None):
        if psutil_module is None:
            import psutil as psutil_module
        self.psutil = psutil_module
        self.me = psutil_module.Process()
        self.children = children or _proc_children
        self.workers: dict[int, Any] = {}  # pid -> psutil.Process (kept: its CPU is cumulative)
        self.last: dict[str, Any] | None = None
        self.cpu_count = psutil_module.cpu_count() or 1

    def _child_pids(self) -> list[int]:
        pids = self.children()
        if pids is None:  # no /proc: psutil's scan (slow, but not Linux anyway)
            pids = [child.pid for child in self.me.children()]
        return pids

    def read(self, now_s: float) -> dict[str, Any]:
        psutil = self.psutil
        mine = self.me.cpu_times()
        worker_cpu = 0.0
        alive: dict[int, Any] = {}
        for pid in self._child_pids():
            process = self.workers.get(pid) or psutil.Process(pid)
            try:
                times = process.cpu_times()
            except psutil.Error:
                continue
            alive[pid] = process
            worker_cpu += times.user + times.system
        system = psutil.cpu_times()
        memory = psutil.virtual_memory()
        current = {
            "t": now_s,
            "process": mine.user + mine.system,
            "workers": worker_cpu,
            "worker_pids": set(alive),
            "busy": system.user
            + system.system
            + getattr(system, "nice", 0.0)
            + getattr(system, "irq", 0.0)
            + getattr(system, "softirq", 0.0),
            "total": sum(system),
        }
        sample: dict[str, Any] = {
            schema.CPU_PROCESS_PCT: None,
            schema.CPU_WORKERS_PCT: None,
            schema.CPU_SYSTEM_PCT: None,
            schema.WORKER_PROCESSES: len(alive),
            schema.CPU_COUNT: self.cpu_count,
            schema.HOST_MEM_AVAILABLE: int(memory.available),
            schema.HOST_MEM_TOTAL: int(memory.total),
        }
        last = self.last
        if last is not None and current["t"] > last["t"]:
            wall = current["t"] - last["t"]
            sample[schema.CPU_PROCESS_PCT] = 100.0 * (current["process"] - last["process"]) / wall
            # A worker that exited took its CPU time with it; one that started brings all of
            # its own: count only workers seen both times (the rate of those that continued).
            kept = current["worker_pids"] & last["worker_pids"]
            if kept == current["worker_pids"] == last["worker_pids"]:
                delta = current["workers"] - last["workers"]
                sample[schema.CPU_WORKERS_PCT] = max(0.0, 100.0 * delta / wall)
            total = current["total"] - last["total"]
            if total > 0:
                busy = current["busy"] - last["busy"]
                sample[schema.CPU_SYSTEM_PCT] = max(0.0, min(100.0, 100.0 * busy / total))
        self.workers = alive
        self.last = current
        return sample


class CudaProbe:
    """The caching allocator's counters (current allocated/reserved, retries, OOMs) and, when
    ``nvml`` is given, NVML's utilization, memory, temperature and power."""

    def __init__(self, memory_stats: Callable[[], dict[str, Any]], nvml: Any = None) -> None:
        self.memory_stats = memory_stats
        self.nvml = nvml

    def read(self) -> dict[str, Any]:
        stats = self.memory_stats()
        sample = {
            schema.DEVICE_MEM_ALLOCATED: stats.get("allocated_bytes.all.current"),
            schema.DEVICE_MEM_RESERVED: stats.get("reserved_bytes.all.current"),
            schema.ALLOC_RETRIES: stats.get("num_alloc_retries"),
            schema.DEVICE_OOMS: stats.get("num_ooms"),
        }
        if self.nvml is not None:
            try:
                sample.update(self.nvml.read())
            except Exception:
                self.nvml = None  # NVML is optional: one failure and it is left alone
        return sample


class NvmlProbe:
    """NVML's view of one device (nvidia-ml-py, imported as ``pynvml``)."""

    def __init__(self, pynvml: Any, handle: Any) -> None:
        self.pynvml = pynvml
        self.handle = handle

    def read(self) -> dict[str, Any]:
        nvml, handle = self.pynvml, self.handle
        rates = nvml.nvmlDeviceGetUtilizationRates(handle)
        sample: dict[str, Any] = {schema.NVML_GPU_UTIL_PCT: float(rates.gpu)}
        try:
            sample[schema.NVML_TEMPERATURE_C] = float(
                nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)
            )
            sample[schema.NVML_POWER_W] = nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0
        except Exception:
            pass  # not every board reports these
        return sample


def nvml_probe(device_index: int, uuid: str | None = None, pynvml: Any = None) -> NvmlProbe | None:
    """An NVML probe for the device, or None when nvidia-ml-py is not installed or NVML
    cannot be initialised (it is an optional extra)."""
    try:
        if pynvml is None:
            import pynvml
        pynvml.nvmlInit()
        # torch's index counts the devices in CUDA_VISIBLE_DEVICES; NVML's counts them all:
        # find the device by UUID when torch gives one.
        if uuid:
            name = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
            handle = pynvml.nvmlDeviceGetHandleByUUID(name)
        else:
            handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        return NvmlProbe(pynvml, handle)
    except Exception:
        return None


def cuda_probe(device: Any) -> CudaProbe | None:
    """The allocator (and NVML) probe for a torch CUDA device, or None."""
    try:
        import torch

        index = device.index if device.index is not None else torch.cuda.current_device()
        uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", "") or "") or None
    except Exception:
        return None
    return CudaProbe(lambda: torch.cuda.memory_stats(index), nvml_probe(index, uuid))


# How long stop() waits for the thread, then for a sample in progress (each at most once).
STOP_WAIT_S = 2.0


class TelemetrySampler:
    """The sampling thread and its queue (see the module docstring)."""

    def __init__(
        self,
        *,
        origin_ns: int,
        host: Any = None,
        cuda: Any = None,
        interval_s: float = SAMPLE_INTERVAL_S,
    ) -> None:
        self.origin_ns = origin_ns
        self.host = host
        self.cuda = cuda
        self.interval_s = interval_s
        self.pending: deque[dict[str, Any]] = deque(maxlen=QUEUE_LENGTH)
        self.own_cost_ns = 0  # time in the guarded calls (traceml.capture.guard adds to it)
        self.cpu_ns = 0  # CPU time of the thread's samples (its own cost, reported)
        self.failures = 0
        self.off: str | None = None  # why telemetry turned itself off
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one sample at a time (the thread, or stop's last)

    # -- the calls the callback makes (guarded) ---------------------------------------------

    @entry_point("telemetry.start", "the telemetry sampler starting, when tracing starts")
    def start(self) -> None:
        self._sample_once()  # the baseline for CPU rates, and host memory at the start
        self._thread = threading.Thread(target=self._run, name="traceml-telemetry", daemon=True)
        self._thread.start()

    @entry_point(
        "telemetry.collect", "taking queued telemetry samples, with a step record", default=()
    )
    def collect(self) -> list[dict[str, Any]]:
        taken = []
        pending = self.pending
        while pending:
            taken.append(pending.popleft())
        return taken

    @entry_point("telemetry.stop", "the telemetry sampler stopping, when tracing ends", default=())
    def stop(self) -> list[dict[str, Any]]:
        """Stop the thread, take a last sample, return what has not been collected."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=STOP_WAIT_S)
        # A sample still hung (an NVML call that never returns) holds the lock: no last
        # sample then, rather than hanging the training's teardown behind it.
        if self.off is None and self._lock.acquire(timeout=STOP_WAIT_S):
            self._lock.release()
            self._sample_once()
        taken = list(self.pending)
        self.pending.clear()
        return taken

    def _entry_failed(self, name: str, exc: BaseException) -> None:
        self._turn_off(f"{name} failed ({type(exc).__name__}: {exc})")

    # -- the thread --------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.interval_s):
                if not self._sample_once():
                    self.failures += 1
                    if self.failures >= MAX_FAILURES:
                        self._turn_off(f"{self.failures} samples in a row failed")
                        return
                else:
                    self.failures = 0
        except BaseException as exc:  # a daemon thread's error must not print a traceback
            try:
                self._turn_off(f"the sampler stopped ({type(exc).__name__})")
            except BaseException:
                pass

    def _sample_once(self) -> bool:
        """Take one sample into the queue; False when it failed."""
        with self._lock:
            cpu_start = time.thread_time_ns()
            try:
                now = clock_ns()
                sample: dict[str, Any] = {
                    schema.KIND: schema.KIND_SAMPLE,
                    schema.T_START_MS: (now - self.origin_ns) / 1e6,
                }
                if self.host is not None:
                    sample.update(self.host.read(now / 1e9))
                if self.cuda is not None:
                    sample.update(self.cuda.read())
                self.cpu_ns += time.thread_time_ns() - cpu_start
                sample[schema.TELEMETRY_CPU_US] = self.cpu_ns / 1000.0
                self.pending.append(sample)
                return True
            except Exception:
                self.cpu_ns += time.thread_time_ns() - cpu_start
                return False

    def _turn_off(self, reason: str) -> None:
        self._stop.set()
        if self.off is None:
            self.off = reason
            console.warn(
                f"telemetry off: {reason}; step tracing and training continue", all_ranks=True
            )


def sampler_for(
    device: Any, origin_ns: int, interval_s: float = SAMPLE_INTERVAL_S
) -> TelemetrySampler | None:
    """A sampler for this rank: host probes always, allocator/NVML on a CUDA device."""
    try:
        cuda = cuda_probe(device) if getattr(device, "type", None) == "cuda" else None
        host = HostProbe()
    except Exception as exc:  # psutil broken or missing: no telemetry, tracing goes on
        console.warn(f"telemetry off: {type(exc).__name__}: {exc}", all_ranks=True)
        return None
    return TelemetrySampler(origin_ns=origin_ns, host=host, cuda=cuda, interval_s=interval_s)
