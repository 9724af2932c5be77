"""TRACEML_* environment <-> :class:`Settings`; the only module that reads the environment.

(The one guarded line of ``traceml_bootstrap.pth`` also looks at ``TRACEML``: it must decide
before importing anything.) The launcher writes settings back with :func:`settings_to_env`, so
every process of one launch, however it was started, reads the same values here.
"""

from __future__ import annotations

# This module loads at interpreter start in every TRACEML=1 process: standard modules that are
# already loaded by then (os, sys, time) only; no dataclasses, re or pathlib (together ~25 ms).
import os
import sys
import time

from traceml.errors import SettingsError, ThresholdError
from traceml.thresholds import parse_threshold_override
from traceml_bootstrap import OFF_VALUES

# typing costs ~8 ms to import at start-up; annotations are strings (PEP 563) anyway.
TYPE_CHECKING = False

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, MutableMapping, Sequence
    from pathlib import Path

ENV_ENABLE = "TRACEML"
ENV_LOGS_DIR = "TRACEML_LOGS_DIR"
ENV_RUN_NAME = "TRACEML_RUN_NAME"
ENV_TRACE_MAX_STEPS = "TRACEML_TRACE_MAX_STEPS"
ENV_REPORT = "TRACEML_REPORT"
ENV_REPORT_WAIT_S = "TRACEML_REPORT_WAIT_S"
ENV_HTML = "TRACEML_HTML"
ENV_THRESHOLD_PREFIX = "TRACEML_THRESHOLD_"
# Internal: set by `traceml run` so ranks leave the final report to the launcher.
ENV_LAUNCHER = "TRACEML_LAUNCHER"
# Internal: set by the first traceml-enabled process of a launch (the torchrun agent, or a
# single-process script before Lightning re-launches it) so every rank derives one run name.
ENV_LAUNCH_STAMP = "TRACEML_LAUNCH_STAMP"
# Internal: "1" when TRACEML_RUN_NAME was derived by traceml, not chosen by the user. Ranks of
# one job then adopt global rank 0's name at start-up, so they always share one directory.
ENV_RUN_NAME_DERIVED = "TRACEML_RUN_NAME_DERIVED"

DEFAULT_LOGS_DIR = "logs"
DEFAULT_REPORT_WAIT_S = 10.0

_OFF_VALUES = frozenset(OFF_VALUES)  # the rule the start-up hook applies to TRACEML
_ON_VALUES = frozenset({"1", "true", "yes", "on"})
_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")
_NAME_MAX = 128
_DERIVED_NAME_MAX = 80  # a name traceml makes up (script stem + launch stamp)


class Settings:
    """What tracing runs with. Immutable by convention: use :meth:`replace` for a variant."""

    __slots__ = (
        "_logs_dir",
        "html",
        "launcher_managed",
        "report",
        "report_wait_s",
        "run_name",
        "run_name_explicit",
        "thresholds",
        "trace_max_steps",
    )

    def __init__(
        self,
        logs_dir: str | os.PathLike[str],
        run_name: str,
        trace_max_steps: int | None = None,
        report: bool = True,
        report_wait_s: float = DEFAULT_REPORT_WAIT_S,
        html: bool = False,
        launcher_managed: bool = False,
        thresholds: dict[str, float] | None = None,
        run_name_explicit: bool = True,
    ) -> None:
        self._logs_dir = os.fspath(logs_dir)
        self.run_name = run_name
        self.trace_max_steps = trace_max_steps
        self.report = report
        self.report_wait_s = report_wait_s
        self.html = html
        self.launcher_managed = launcher_managed
        self.thresholds = dict(thresholds or {})
        self.run_name_explicit = run_name_explicit

    @property
    def logs_dir(self) -> Path:
        from pathlib import Path

        return Path(self._logs_dir)

    @property
    def run_dir(self) -> Path:
        return self.logs_dir / self.run_name

    def as_dict(self) -> dict[str, object]:
        values = {name: getattr(self, name) for name in self.__slots__ if name != "_logs_dir"}
        return {"logs_dir": self._logs_dir, **values}

    def replace(self, **changes: object) -> Settings:
        return Settings(**{**self.as_dict(), **changes})

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Settings) and self.as_dict() == other.as_dict()

    def __hash__(self) -> int:
        return hash(self._logs_dir + "/" + self.run_name)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.as_dict().items())
        return f"Settings({fields})"


class DistributedEnv:
    """What a launcher (torchrun, Lightning, SLURM-free setups) told this process about itself."""

    __slots__ = ("elastic_run_id", "local_rank", "node_rank", "rank", "world_size")

    def __init__(
        self,
        rank: int | None,
        local_rank: int | None,
        world_size: int | None,
        node_rank: int | None,
        elastic_run_id: str | None,
    ) -> None:
        self.rank = rank
        self.local_rank = local_rank
        self.world_size = world_size
        self.node_rank = node_rank
        self.elastic_run_id = elastic_run_id


def is_valid_run_name(name: str) -> bool:
    """Letters, digits, '.', '_' and '-', starting with a letter or digit, at most 128."""
    return (
        0 < len(name) <= _NAME_MAX
        and name[0].isascii()
        and name[0].isalnum()
        and all(char in _NAME_CHARS for char in name)
    )


def sanitize_run_name(text: str) -> str:
    """Turn a script stem into something :func:`is_valid_run_name` accepts."""
    cleaned = "".join(char if char in _NAME_CHARS else "_" for char in text).strip("._-")
    return (cleaned or "run")[:_DERIVED_NAME_MAX]


def stamped_run_name(stem: str, stamp: str) -> str:
    """``<stem>-<stamp>``, at most ``_DERIVED_NAME_MAX`` characters: a long stem is cut, never
    the stamp, which alone tells two launches of one script apart (cut after it was added,
    the second launch found the first one's directory)."""
    suffix = sanitize_run_name(stamp)[: _DERIVED_NAME_MAX - 2]
    return f"{sanitize_run_name(stem)[: _DERIVED_NAME_MAX - 1 - len(suffix)]}-{suffix}"


def make_launch_stamp(now: float | None = None) -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() if now is None else now))


def interpreter_target(argv: Sequence[str]) -> tuple[str, str]:
    """What an interpreter command line runs: ``("script", path)``, ``("module", name)``,
    ``("code", source)`` or ``("none", "")``, from ``sys.orig_argv``-style arguments."""
    args = list(argv[1:])
    index = 0
    while index < len(args):
        arg = args[index]
        index += 1
        if arg == "-" or not arg.startswith("-"):
            return "script", arg
        if arg.startswith("--"):
            if arg == "--check-hash-based-pycs":  # the one long option with a value
                index += 1
            continue
        # One-letter flags cluster as CPython's Python/getopt.c reads them (-um MODULE,
        # -Bm pkg.train, -Ec CODE): -m and -c end the options, -W and -X end the cluster; each
        # takes the rest of the cluster as its value, or else the next argument.
        for position, letter in enumerate(arg[1:], start=2):
            rest = arg[position:]
            if letter in "mc":
                kind = "module" if letter == "m" else "code"
                return kind, rest or (args[index] if index < len(args) else "")
            if letter in "WX":
                if not rest:
                    index += 1
                break
    return "none", ""


def script_stem(argv: Sequence[str]) -> str:
    """``python train.py`` -> ``train``; ``python -m pkg.train`` -> ``train``; else ``python``."""
    kind, target = interpreter_target(argv)
    if kind == "module":
        return sanitize_run_name(target.rsplit(".", 1)[-1])
    if kind == "script" and target != "-":
        return sanitize_run_name(os.path.splitext(os.path.basename(target))[0])
    return "python"


def _parse_bool(name: str, raw: str, default: bool) -> bool:
    value = raw.strip().lower()
    if value == "":
        return default
    if value in _ON_VALUES:
        return True
    if value in _OFF_VALUES:
        return False
    raise SettingsError(f"{name}={raw!r} is not a yes/no value (use 1 or 0)")


def _parse_positive_int(name: str, raw: str) -> int | None:
    value = raw.strip()
    if value == "":
        return None
    try:
        number = int(value)
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not a whole number") from None
    if number < 1:
        raise SettingsError(f"{name}={raw!r} must be at least 1")
    return number


def _parse_seconds(name: str, raw: str, default: float) -> float:
    value = raw.strip()
    if value == "":
        return default
    try:
        number = float(value)
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not a number of seconds") from None
    if not 0 <= number < float("inf"):  # (inf: a rank 0 waiting for a crashed rank forever)
        raise SettingsError(f"{name}={raw!r} must be a finite number of seconds, zero or more")
    return number


def threshold_variables(names: Iterable[str]) -> set[str]:
    """The TRACEML_THRESHOLD_* variables that options for ``names`` replace: a command given
    ``--threshold NAME=VALUE`` does not read them, so a bad one there is no error."""
    return {ENV_THRESHOLD_PREFIX + name.upper() for name in names}


def parse_threshold_env(environ: Mapping[str, str]) -> dict[str, float]:
    overrides: dict[str, float] = {}
    for key, raw in environ.items():
        if not key.startswith(ENV_THRESHOLD_PREFIX):
            continue
        try:
            name, value = parse_threshold_override(key[len(ENV_THRESHOLD_PREFIX) :], raw)
        except ThresholdError as exc:
            raise SettingsError(f"{key}: {exc}") from None
        overrides[name] = value
    return overrides


def default_run_name(
    environ: Mapping[str, str], argv: Sequence[str], now: float | None = None
) -> str:
    """A run name every rank of one launch derives alike, with no flag.

    Order: the launch stamp left by the first traced process (torchrun's agent, or rank 0
    before Lightning starts the other local ranks); then torchelastic's run id when the user
    chose one (multi-node launches share it); then this process's own start time.
    """
    stem = script_stem(argv)
    stamp = environ.get(ENV_LAUNCH_STAMP, "").strip()
    if stamp:
        return stamped_run_name(stem, stamp)
    run_id = environ.get("TORCHELASTIC_RUN_ID", "").strip()
    if run_id and run_id != "none":
        return stamped_run_name(stem, run_id)
    return stamped_run_name(stem, make_launch_stamp(now))


def check_enable(environ: Mapping[str, str]) -> None:
    """Any TRACEML value but an off one starts traceml at interpreter start; one that is no
    yes/no value (TRACEML=disabled) is named, and the process traces nothing, as for every
    other yes/no variable (:class:`SettingsError`)."""
    _parse_bool(ENV_ENABLE, environ.get(ENV_ENABLE, "1"), True)


def load_settings(
    environ: Mapping[str, str] | None = None,
    argv: Sequence[str] | None = None,
    now: float | None = None,
    cwd: Path | None = None,
) -> Settings:
    """Read every TRACEML_* variable; raise :class:`SettingsError` naming the first bad one."""
    env = os.environ if environ is None else environ
    args = list(getattr(sys, "orig_argv", sys.argv) if argv is None else argv)
    base = os.getcwd() if cwd is None else os.fspath(cwd)

    logs_raw = env.get(ENV_LOGS_DIR, "").strip() or DEFAULT_LOGS_DIR
    logs_dir = os.path.normpath(os.path.join(base, os.path.expanduser(logs_raw)))

    run_name = env.get(ENV_RUN_NAME, "").strip()
    explicit = bool(run_name) and not _parse_bool(
        ENV_RUN_NAME_DERIVED, env.get(ENV_RUN_NAME_DERIVED, ""), False
    )
    if run_name:
        if not is_valid_run_name(run_name):
            raise SettingsError(
                f"{ENV_RUN_NAME}={run_name!r} is not a safe run name "
                "(letters, digits, '.', '_' and '-' only, starting with a letter or digit, "
                "at most 128 characters)"
            )
    else:
        run_name = default_run_name(env, args, now)

    return Settings(
        logs_dir=logs_dir,
        run_name=run_name,
        trace_max_steps=_parse_positive_int(ENV_TRACE_MAX_STEPS, env.get(ENV_TRACE_MAX_STEPS, "")),
        report=_parse_bool(ENV_REPORT, env.get(ENV_REPORT, ""), True),
        report_wait_s=_parse_seconds(
            ENV_REPORT_WAIT_S, env.get(ENV_REPORT_WAIT_S, ""), DEFAULT_REPORT_WAIT_S
        ),
        html=_parse_bool(ENV_HTML, env.get(ENV_HTML, ""), False),
        launcher_managed=_parse_bool(ENV_LAUNCHER, env.get(ENV_LAUNCHER, ""), False),
        thresholds=parse_threshold_env(env),
        run_name_explicit=explicit,
    )


def settings_to_env(settings: Settings) -> dict[str, str]:
    """The environment that makes :func:`load_settings` return ``settings`` in a child."""
    env = {
        ENV_ENABLE: "1",
        ENV_LOGS_DIR: settings.as_dict()["logs_dir"],
        ENV_RUN_NAME: settings.run_name,
        ENV_REPORT: "1" if settings.report else "0",
        ENV_REPORT_WAIT_S: repr(settings.report_wait_s),
        ENV_HTML: "1" if settings.html else "0",
        ENV_LAUNCHER: "1" if settings.launcher_managed else "0",
        ENV_RUN_NAME_DERIVED: "0" if settings.run_name_explicit else "1",
    }
    if settings.trace_max_steps is not None:
        env[ENV_TRACE_MAX_STEPS] = str(settings.trace_max_steps)
    for name, value in settings.thresholds.items():
        env[ENV_THRESHOLD_PREFIX + name.upper()] = repr(value)
    return env


def pin_run_name(settings: Settings, environ: MutableMapping[str, str] | None = None) -> None:
    """Export the chosen run name so processes this one starts (Lightning's DDP re-launch of
    the script, spawn workers) join the same run directory."""
    env = os.environ if environ is None else environ
    env[ENV_RUN_NAME] = settings.run_name
    env[ENV_RUN_NAME_DERIVED] = "0" if settings.run_name_explicit else "1"


def mark_launch(environ: MutableMapping[str, str] | None = None, now: float | None = None) -> None:
    """Leave a launch stamp for the processes a launcher agent will start."""
    env = os.environ if environ is None else environ
    if not env.get(ENV_LAUNCH_STAMP) and not env.get(ENV_RUN_NAME):
        env[ENV_LAUNCH_STAMP] = make_launch_stamp(now)


def distributed_env(environ: Mapping[str, str] | None = None) -> DistributedEnv:
    env = os.environ if environ is None else environ

    def as_int(name: str) -> int | None:
        raw = env.get(name, "").strip()
        try:
            return int(raw) if raw else None
        except ValueError:
            return None

    run_id = env.get("TORCHELASTIC_RUN_ID", "").strip() or None
    return DistributedEnv(
        rank=as_int("RANK"),
        local_rank=as_int("LOCAL_RANK"),
        world_size=as_int("WORLD_SIZE"),
        node_rank=as_int("GROUP_RANK") if as_int("GROUP_RANK") is not None else as_int("NODE_RANK"),
        elastic_run_id=run_id,
    )


ENV_FAULT_INJECT = "TRACEML_FAULT_INJECT"  # tests only: the entry point that must fail


def fault_injection_point(environ: Mapping[str, str] | None = None) -> str | None:
    """The traceml entry point the fault-injection tests make raise (see traceml.capture.guard)."""
    env = os.environ if environ is None else environ
    return env.get(ENV_FAULT_INJECT, "").strip() or None
