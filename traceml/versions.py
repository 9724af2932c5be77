"""Versions of the packages a run's numbers depend on (rank headers, the launcher's manifest)."""

from __future__ import annotations

import sys

PACKAGES = ("torch", "pytorch_lightning", "lightning", "rfdetr")


def package_versions() -> dict[str, str | None]:
    """python, torch, both Lightning packages, rfdetr and traceml; None for what is missing."""
    from importlib import metadata

    from traceml._version import __version__

    found: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    found["traceml"] = __version__
    return found
