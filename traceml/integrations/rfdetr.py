"""Alias of the manual entry point: use ``traceml.init(...)``; this path stays until 1.0."""

from traceml import init

__all__ = ["init"]
