"""Everything that runs inside a training process.

Cheap, fail-open and invisible: modules here import torch lazily and never import
:mod:`traceml.analysis` or :mod:`traceml.present` (checked by import-linter in CI). What they
produce is the rank file; the other side reads only that.
"""
