"""Which RF-DETR configurations traceml names unsupported (frameworks/rfdetr.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest


@pytest.mark.parametrize(
    ("device", "accelerator", "named"),
    [("cuda", "auto", True), ("cuda", "gpu", True), ("cuda", "cpu", False), ("cpu", "auto", False)],
)
def test_rfdetr_compile_is_unsupported_only_where_rfdetr_compiles(
    monkeypatch, device, accelerator, named
):
    """RF-DETR compiles only on a CUDA device with a CUDA-family accelerator
    (rfdetr/training/module_model.py); a CPU run on a CUDA host trains eagerly and is traced."""
    pytest.importorskip("rfdetr")
    import rfdetr.config

    from traceml.capture.frameworks.rfdetr import unsupported_model

    monkeypatch.setattr(rfdetr.config, "DEVICE", device)
    reason = unsupported_model(
        SimpleNamespace(compile=True), SimpleNamespace(accelerator=accelerator)
    )
    assert (reason is not None and reason.startswith("torch.compile")) is named
    assert unsupported_model(SimpleNamespace(compile=False), None) is None
