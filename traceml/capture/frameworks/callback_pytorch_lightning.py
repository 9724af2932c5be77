"""The step callback for ``pytorch_lightning`` (the package RF-DETR trains with); a module of
its own, like callback_lightning, for pickling and lazy imports."""

from pytorch_lightning import Callback

from traceml.capture.frameworks.lightning import StepTiming


class PytorchLightningStepCallback(StepTiming, Callback):
    pass
