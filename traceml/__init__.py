"""traceml: why is my training slow, and did my change make it faster?

Importing this package is cheap and has no side effects; tracing starts either at interpreter
start (``TRACEML=1``, through ``traceml_bootstrap.pth``) or from :func:`init`.
"""

from traceml._version import __version__

__all__ = ["__version__", "init"]


def init(**overrides: object) -> None:
    """Trace the next training in this process (manual activation): Lightning, RF-DETR, a
    Hugging Face Trainer or any PyTorch loop.

    Same effect as launching with ``TRACEML=1``. Keyword overrides: ``logs_dir``, ``run_name``,
    ``trace_max_steps``, ``report``. See :func:`traceml.capture.manual.init`.
    """
    from traceml.capture.manual import init as _init

    _init(**overrides)
