"""The errors a user can fix, each printed as one line by ``cli.main`` with its exit code.

Lower layers raise these and never print or exit; ``cli.main`` is the one place that turns
them into ``traceml: error: <message>`` on stderr and a return code (coverage.py's
``CoverageException`` / ``cmdline.py`` split). This module imports nothing: ``settings`` and
``thresholds`` load at interpreter start in every traced process and use it.
"""

from __future__ import annotations

EXIT_USAGE = 2


class UserError(Exception):
    """Something the user asked for or pointed at cannot be done; the message says why and,
    where it can, what to do. ``exit_code`` is what ``traceml`` exits with."""

    exit_code = EXIT_USAGE


class UsageError(UserError):
    """A bad command line (an option value, a combination of options)."""


class LaunchError(UsageError):
    """``traceml run`` cannot start the script (missing script, bad topology, taken run name)."""


class ReduceError(UserError):
    """A run directory that cannot be summarised at all (no rank files, a newer schema)."""


class OutputError(UserError):
    """A result that cannot be written (permissions, a directory where a file should be)."""


class ThresholdError(UserError, ValueError):
    """A threshold override names an unknown threshold or gives a value that is not a number."""


class SettingsError(UserError, ValueError):
    """A TRACEML_* value that cannot be honoured; the message names the variable."""

# A failure inside traceml itself (a bug, not the user's input): a code of its own, never 1
# (compare's "regression") nor 2 or 3, so that no CI gate reads a crash as a verdict.
# 70 is EX_SOFTWARE in BSD's sysexits.h ("internal software error").
EXIT_INTERNAL = 70
