"""Field names and versions of everything traceml writes: rank files and summaries.

Every other module names fields through these constants, so a rename happens here once.
Versions are "MAJOR.MINOR": readers accept any MINOR of a MAJOR they know and refuse a newer
MAJOR with a one-line error.
"""

from __future__ import annotations

# 1.2: "sample" records (telemetry); 1.3: compact steps; 2.0: short step keys (STEP_KEYS); 3.0:
# usual steps many to a line (KIND_STEP_ROWS). Majors because an older reader would find no
# step (2.0) or miss most of them (3.0) rather than refuse the file.
RANK_SCHEMA = "traceml.rank/3.0"
SUMMARY_SCHEMA = "traceml.summary/1.3"  # 1.2: telemetry per rank; 1.3: "exactness"
COMPARISON_SCHEMA = "traceml.comparison/2.0"
MANIFEST_SCHEMA = "traceml.manifest/1.0"

# Record kinds (one JSON object per line in ranks/rank_<R>.jsonl).
KIND = "kind"
KIND_HEADER = "header"
KIND_STEP = "step"
KIND_EVENT = "event"
KIND_FOOTER = "footer"
# Low rate (once per epoch): what the training DataLoader's workers (or the main process, with
# num_workers=0) spent per batch in __getitem__, collate_fn and idle; worker start-up.
KIND_INPUT = "input"
# Rank schema 3.0: the usual steps of one flush (one-door timing), as the door events'
# integers, one row a step; readers make the step records (traceml/step_rows.py).
KIND_STEP_ROWS = "steps"
ROWS = "rows"
ROWS_ORIGIN_NS = "origin_ns"  # the clock's origin: a row's t_ms counts from it
ROWS_FIRST_STEP = "first_step"  # the first row's step index
ROWS_LAST_END_NS = "last_end_ns"  # the end of the step before the first row (its gap_ms)
ROWS_COST_NS = "cost_ns"  # traceml's cost reported up to the step before the first row
ROWS_WRITE_NS = "write_ns"  # the flusher's write time, counted in the first row's traceml_us

# Phases of one optimizer step, in the order they happen; residual is what none of them covers.
INPUT_WAIT = "input_wait_ms"
H2D = "h2d_ms"
FORWARD = "forward_ms"
BACKWARD = "backward_ms"
OPTIMIZER = "optimizer_ms"
RESIDUAL = "residual_ms"
STEP = "step_ms"
PHASES: tuple[str, ...] = (INPUT_WAIT, H2D, FORWARD, BACKWARD, OPTIMIZER, RESIDUAL)
TIMED_FIELDS: tuple[str, ...] = (*PHASES, STEP)

PHASE_LABELS: dict[str, str] = {
    INPUT_WAIT: "Input Wait",
    H2D: "H2D",
    FORWARD: "Forward",
    BACKWARD: "Backward",
    OPTIMIZER: "Optimizer",
    RESIDUAL: "Residual",
    STEP: "Step",
}

# Column headings where space is short (per-rank table, live view).
PHASE_SHORT_LABELS: dict[str, str] = {
    INPUT_WAIT: "Input",
    H2D: "H2D",
    FORWARD: "Fwd",
    BACKWARD: "Bwd",
    OPTIMIZER: "Opt",
    RESIDUAL: "Resid",
    STEP: "Step",
}

# Device-side (CUDA event) times of the same phases; null on CPU.
GPU_H2D = "gpu_h2d_ms"
GPU_FORWARD = "gpu_forward_ms"
GPU_BACKWARD = "gpu_backward_ms"
GPU_OPTIMIZER = "gpu_optimizer_ms"
GPU_STEP = "gpu_step_ms"
GPU_FIELDS: tuple[str, ...] = (GPU_H2D, GPU_FORWARD, GPU_BACKWARD, GPU_OPTIMIZER, GPU_STEP)
GPU_OF_PHASE: dict[str, str] = {
    H2D: GPU_H2D,
    FORWARD: GPU_FORWARD,
    BACKWARD: GPU_BACKWARD,
    OPTIMIZER: GPU_OPTIMIZER,
    STEP: GPU_STEP,
}

# Waiting on other ranks (distributed runs only; null when the process is alone): time spent
# blocked in torch.distributed collectives and DDP's gradient buckets, split by the phase it
# fell in. It is *inside* that phase, so a phase's own time is the phase minus its comm field
# and the phases still add up to the step.
COMM = "comm_ms"
COMM_OF_PHASE: dict[str, str] = {
    INPUT_WAIT: "comm_input_wait_ms",
    H2D: "comm_h2d_ms",
    FORWARD: "comm_forward_ms",
    BACKWARD: "comm_backward_ms",
    OPTIMIZER: "comm_optimizer_ms",
    RESIDUAL: "comm_residual_ms",
}
COMM_COUNT = "comm_count"  # collectives (and DDP buckets) in the step
COMM_BYTES = "comm_bytes"  # their tensor payload (0 for barrier and object collectives)
# Device-side (CUDA event) time of the same waits: on NCCL the host does not block in a
# collective, so only these show who waited.
GPU_COMM = "gpu_comm_ms"
GPU_COMM_OF_PHASE: dict[str, str] = {
    H2D: "gpu_comm_h2d_ms",
    FORWARD: "gpu_comm_forward_ms",
    BACKWARD: "gpu_comm_backward_ms",
    OPTIMIZER: "gpu_comm_optimizer_ms",
}
COMM_FIELDS: tuple[str, ...] = (COMM, *COMM_OF_PHASE.values(), COMM_COUNT, COMM_BYTES)
GPU_COMM_FIELDS: tuple[str, ...] = (GPU_COMM, *GPU_COMM_OF_PHASE.values())

# Step record fields besides the phases.
STEP_INDEX = "step"
GLOBAL_STEP = "global_step"
EPOCH = "epoch"
MICROBATCHES = "microbatches"
T_START_MS = "t_ms"  # step start, ms since the header's clock origin
GAP_MS = "gap_ms"  # time since the previous step ended (validation, checkpoints, epoch ends)
MEM_PEAK_ALLOCATED = "mem_peak_allocated_bytes"
MEM_PEAK_RESERVED = "mem_peak_reserved_bytes"
RSS = "rss_bytes"
RSS_HWM = "rss_hwm_bytes"  # footer: the process RSS high-water mark, the kernel VmHWM
OPTIMIZER_STEPPED = "optimizer_stepped"
# traceml's own cost: time spent inside its hooks and writes since the previous step record
# (the record's own write counts towards the next one), microseconds.
TRACEML_COST_US = "traceml_us"

# Header fields.
SCHEMA = "schema"
RUN = "run"
RANK = "rank"
LOCAL_RANK = "local_rank"
WORLD_SIZE = "world_size"
LOCAL_WORLD_SIZE = "local_world_size"  # ranks per node
NODE_RANK = "node_rank"
HOST = "host"
PID = "pid"
JOB = "job"  # the launch: torchelastic's run id and rendezvous port (null: one process)
STARTED_AT = "started_at"  # ISO-8601, UTC
CLOCK_ORIGIN_UNIX = "clock_origin_unix"  # wall time (s) at perf_counter origin, to align ranks
VERSIONS = "versions"
DEVICE = "device"
DEVICE_TYPE = "type"
DEVICE_NAME = "name"
DEVICE_TOTAL_MEMORY = "total_memory_bytes"
TIMING = "timing"  # "host" or "host+cuda_events"
COMM_TIMING = "comm_timing"  # null (one process), "host" or "host+cuda_events"
BUCKET_TIMING = "bucket_timing"  # DDP gradient buckets: "on", "off" or null (no DDP)
SCRIPT = "script"
INTEGRATION = "integration"
ACCUMULATE_GRAD_BATCHES = "accumulate_grad_batches"
BATCH_SIZE = "batch_size"
SETTINGS = "settings"

# Event fields.
LEVEL = "level"
CODE = "code"
MESSAGE = "message"

# Footer fields.
STATUS = "status"
STEPS = "steps"
ENDED_AT = "ended_at"
ERROR = "error"

# The exception a rank stopped on: the footer's ERROR is "<type name>: <first line>"; writers
# that know the type name alone may also set ERROR_TYPE.
ERROR_TYPE = "error_type"

STATUS_COMPLETED = "completed"
STATUS_EXCEPTION = "exception"
STATUS_INTERRUPTED = "interrupted"
STATUS_DISABLED = "disabled"  # traceml turned itself off mid-run (see the event lines)
STATUS_UNSUPPORTED = "unsupported"  # the configuration was not traced at all

# Event codes.
EVENT_UNSUPPORTED = "unsupported"
EVENT_DISABLED = "disabled"
EVENT_MAX_STEPS = "trace_max_steps_reached"
EVENT_VERSION = "untested_version"
EVENT_NOTE = "note"
EVENT_BUCKET_TIMING_OFF = "bucket_timing_off"
# The header's integration corrected before any step (a forward before HF's train()): reader's.
EVENT_INTEGRATION = "integration"


def schema_major(schema: object, family: str) -> int | None:
    """The MAJOR of ``"<family>/<MAJOR>.<MINOR>"``, or None when it is not of that family."""
    if not isinstance(schema, str) or not schema.startswith(family + "/"):
        return None
    version = schema[len(family) + 1 :]
    major, _, _minor = version.partition(".")
    return int(major) if major.isdigit() else None


def family_and_major(schema: str) -> tuple[str, int]:
    family, _, version = schema.partition("/")
    return family, int(version.partition(".")[0])


def rank_file_name(rank: int) -> str:
    return f"rank_{rank}.jsonl"


RANKS_DIR = "ranks"
SUMMARY_JSON = "final_summary.json"
SUMMARY_TXT = "final_summary.txt"
REPORT_HTML = "report.html"
MANIFEST_JSON = "manifest.json"

# --- Summary (final_summary.json) ------------------------------------------------------------
# Top level.
SUMMARY_RUN_DIR = "run_dir"
SUMMARY_GENERATED_AT = "generated_at"
SUMMARY_STATUS = "status"  # one of RUN_STATUSES
RUN_COMPLETED = "completed"
RUN_PARTIAL = "partial"  # a rank missing, or a file without its header or footer
RUN_FAILED = "failed"  # a rank ended on an exception
RUN_INTERRUPTED = "interrupted"  # Ctrl-C / SIGTERM
RUN_UNSUPPORTED = "unsupported"  # no rank was traced (the setup is not supported)
RUN_EMPTY = "empty"  # traced, but no step recorded
RUN_STATUSES: tuple[str, ...] = (
    RUN_COMPLETED,
    RUN_PARTIAL,
    RUN_FAILED,
    RUN_INTERRUPTED,
    RUN_UNSUPPORTED,
    RUN_EMPTY,
)
SUMMARY_SETUP = "setup"
SUMMARY_RANKS_EXPECTED = "ranks_expected"
SUMMARY_RANKS_FOUND = "ranks_found"
SUMMARY_RANKS_MISSING = "ranks_missing"
SUMMARY_WARMUP = "warmup_steps_skipped"
SUMMARY_STEPS_RECORDED = "steps_recorded"
SUMMARY_STEPS_ANALYSED = "steps_analysed"
SUMMARY_OVERALL = "overall"
SUMMARY_RANKS = "ranks"
SUMMARY_IMBALANCE = "imbalance"
SUMMARY_VERDICTS = "verdicts"
SUMMARY_NOTES = "notes"
SUMMARY_THRESHOLDS = "thresholds"
SUMMARY_APPROXIMATE = "approximate_quantiles"

# Inside "overall" and each entry of "ranks".
PHASE_STATS = "phases"  # field -> {count, sum, mean, min, median, p90, max}
SHARES = "shares"  # phase -> fraction of step time (sum of phase / sum of step)
STEPS_PER_S = "steps_per_s"
SAMPLES_PER_S = "samples_per_s"
PEAK_ALLOCATED = "mem_peak_allocated_bytes"
PEAK_RESERVED = "mem_peak_reserved_bytes"
PEAK_RSS = "rss_peak_bytes"
BETWEEN_STEPS_MS = "between_steps_ms"  # sum of gap_ms: validation, checkpoints, epoch ends
WALL_MS = "wall_ms"  # first step start to last step end
# Last step end to the end of training (the footer): final validation, checkpoints, teardown.
AFTER_LAST_STEP_MS = "after_last_step_ms"
DISTRIBUTIONS = "distributions"  # field -> DISTRIBUTION_POINTS quantiles (overall only)
TIMELINE = "timeline"  # rank only: {"steps_per_bin", "first_step", "bins": [{phase: ms}]}
# A rank's own time: the step minus its waits on other ranks (COMM); for files without
# comm fields (older traceml, or comm timing off), step minus Backward, where DDP's all-reduce
# wait sits on gloo.
OWN_MS = "own_ms"
OWN_OF_PHASE: dict[str, str] = {phase: "own_" + phase for phase in PHASES}
# Device-side own time (CUDA): the device step minus its waits, plus the host's Input Wait
# (the device idles while the rank fetches, before its step starts). With NCCL this, not the
# host time, shows who the others wait for.
GPU_OWN_MS = "gpu_own_ms"
GPU_OWN_OF_PHASE: dict[str, str] = {
    phase: "gpu_own_" + phase for phase in (H2D, FORWARD, BACKWARD, OPTIMIZER, RESIDUAL)
}
COMM_SHARE = "comm_share"  # inside "shares": sum of COMM over sum of step time
GPU_COMM_SHARE = "gpu_comm_share"

# Inside each entry of "ranks" besides the statistics: the footer's ERROR and ERROR_TYPE, and
# why the rank was not traced (the EVENT_UNSUPPORTED event's message), or null.
NOT_TRACED_REASON = "not_traced_reason"

# Inside "imbalance".
IMBALANCE_FIELDS = "fields"  # field -> {"max_over_median", "slowest_rank", "rank_medians"}
SLOWEST_RANK = "slowest_rank"

# --- compare (issue 17) ---
# The job's step series (traceml/analysis/job_series.py): one value per step of the whole job, the
# unit compare's statistics need (ranks move in lock-step, so they are not separate samples).
SUMMARY_JOB_SERIES = "job_series"
# The input pipeline's breakdown (traceml/analysis/input_pipeline.py), or null when not timed.
SUMMARY_INPUT_PIPELINE = "input_pipeline"

# --- Verdicts (diagnose.py): each is {VERDICT_KIND, VERDICT_SEVERITY, VERDICT_WHY,
# VERDICT_NEXT, VERDICT_EVIDENCE}. Kinds and severities are compared by identity, never looked
# for in the human-readable text.
VERDICT_KIND = "kind"
VERDICT_SEVERITY = "severity"
VERDICT_WHY = "why"
VERDICT_NEXT = "next"
VERDICT_EVIDENCE = "evidence"

SEVERITY_CRITICAL = "critical"
SEVERITY_WARN = "warn"
SEVERITY_INFO = "info"
SEVERITIES: tuple[str, ...] = (SEVERITY_CRITICAL, SEVERITY_WARN, SEVERITY_INFO)  # worst first

VERDICT_INPUT_BOUND = "INPUT_BOUND"
VERDICT_H2D_BOUND = "H2D_BOUND"
VERDICT_COMPUTE_BOUND = "COMPUTE_BOUND"
VERDICT_OPTIMIZER_HEAVY = "OPTIMIZER_HEAVY"
VERDICT_RESIDUAL_HEAVY = "RESIDUAL_HEAVY"
VERDICT_STRAGGLER = "STRAGGLER"
VERDICT_COMM_BOUND = "COMM_BOUND"
VERDICT_MEMORY_PRESSURE = "MEMORY_PRESSURE"
VERDICT_INSUFFICIENT_DATA = "INSUFFICIENT_DATA"
VERDICT_NO_CLEAR_BOTTLENECK = "NO_CLEAR_BOTTLENECK"
VERDICT_NOT_TRACED = "NOT_TRACED"
VERDICT_KINDS: tuple[str, ...] = (
    VERDICT_INPUT_BOUND,
    VERDICT_H2D_BOUND,
    VERDICT_COMPUTE_BOUND,
    VERDICT_OPTIMIZER_HEAVY,
    VERDICT_RESIDUAL_HEAVY,
    VERDICT_STRAGGLER,
    VERDICT_COMM_BOUND,
    VERDICT_MEMORY_PRESSURE,
    VERDICT_INSUFFICIENT_DATA,
    VERDICT_NO_CLEAR_BOTTLENECK,
    VERDICT_NOT_TRACED,
)

# The most ranks a run can have: a rank file or header beyond it is not believed (a file named
# rank_1000000000.jsonl must not make the reducer list a billion missing ranks).
MAX_WORLD_SIZE = 1 << 20

# --- Telemetry (issue 15): low-rate samples, the memory trend, host and device use ---------
# Rank file: {"kind": "sample", t_ms, at_step, ...} about once a second
# (traceml/capture/telemetry.py),
# written between step records; at_step is how many step records were written before it.
KIND_SAMPLE = "sample"
AT_STEP = "at_step"
CPU_PROCESS_PCT = "cpu_process_pct"  # the rank's main process, % of one core
CPU_WORKERS_PCT = "cpu_workers_pct"  # its child processes (DataLoader workers), % of one core
WORKER_PROCESSES = "worker_processes"
CPU_SYSTEM_PCT = "cpu_system_pct"  # the whole host, % of all its cores
CPU_COUNT = "cpu_count"
HOST_MEM_AVAILABLE = "host_mem_available_bytes"
HOST_MEM_TOTAL = "host_mem_total_bytes"
DEVICE_MEM_ALLOCATED = "device_mem_allocated_bytes"  # now, not the peak
DEVICE_MEM_RESERVED = "device_mem_reserved_bytes"
ALLOC_RETRIES = "alloc_retries"  # cumulative: cudaMalloc retries after freeing the cache
DEVICE_OOMS = "device_ooms"  # cumulative out-of-memory errors the allocator raised
NVML_GPU_UTIL_PCT = "nvml_gpu_util_pct"  # only with nvidia-ml-py installed
NVML_TEMPERATURE_C = "nvml_temperature_c"
NVML_POWER_W = "nvml_power_w"
TELEMETRY_CPU_US = "telemetry_cpu_us"  # the sampler's own CPU time so far (cumulative)

# Summary: each rank entry's TELEMETRY (null for files without samples and on no steps).
TELEMETRY = "telemetry"
MEMORY_TREND = "memory_trend"  # trend.memory_trend(...) plus "basis" (which series)
TREND_BASIS = "basis"  # "rss" (CPU) or "device_allocated" (CUDA)
HOST_CPU = "host_cpu"  # mean/p90 of the CPU figures over the analysed steps' samples
HOST_MEMORY = "host_memory"  # min available, total
DEVICE_MEMORY = "device_memory"  # last allocated/reserved, overhang, retries, OOMs
NVML = "nvml"  # mean utilization, max temperature/power
DEVICE_BUSY = "device_busy"  # CUDA: share of host step time the device ran traced phases
CHARTS = "charts"  # {"memory": [[step, MB]], "cpu": [[step, process, workers, system]]}
# Inside "imbalance": the rank with the most memory over the median of the ranks.
MEMORY_IMBALANCE = "memory"

VERDICT_MEMORY_CREEP = "MEMORY_CREEP"
VERDICT_LOW_DEVICE_UTILIZATION = "LOW_DEVICE_UTILIZATION"
VERDICT_HOST_CPU_SATURATED = "HOST_CPU_SATURATED"
VERDICT_HOST_MEMORY_PRESSURE = "HOST_MEMORY_PRESSURE"
VERDICT_KINDS = (
    *VERDICT_KINDS,
    VERDICT_MEMORY_CREEP,
    VERDICT_LOW_DEVICE_UTILIZATION,
    VERDICT_HOST_CPU_SATURATED,
    VERDICT_HOST_MEMORY_PRESSURE,
)


# ----------------------------------------------------------------------------------------------
# Compact step records (rank schema 1.3, issue 24). A step line carries what was measured: a
# field that is absent reads back as null (unmeasured), except for the defaults below, which
# are omitted when they hold. Host times are whole microseconds. Files of rank schema 1.0-1.2
# carry every field and read back unchanged.
COMPACT_STEPS_SINCE_MINOR = 3
# Absent means this value (an ordinary step: one microbatch, the optimizer stepped).
STEP_DEFAULTS: dict[str, object] = {MICROBATCHES: 1, OPTIMIZER_STEPPED: True}
# When the first field is present (its kind of waiting was measured in this step), an absent
# field of its group means 0: most steps wait in one phase only.
ZERO_WHEN_MEASURED: dict[str, tuple[str, ...]] = {
    COMM: (*COMM_OF_PHASE.values(), COMM_COUNT, COMM_BYTES),
    GPU_COMM: tuple(GPU_COMM_OF_PHASE.values()),
}
HEADER_STEP_KEYS = "step_keys"  # rank schema 2.0 header: {short key: field name}
# Per-node partial reductions (issue 24): each node reduces its own rank files into
# <run_dir>/partials/node_<N>.json; the report merges them (and reads the rest).
PARTIAL_SCHEMA = "traceml.partial/1.0"
PARTIALS_DIR = "partials"
# In a summary: which figures are exact and, for the approximate ones, the bound.
SUMMARY_EXACTNESS = "exactness"
