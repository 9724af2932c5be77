"""The step callback for ``lightning.pytorch`` (a module of its own, so that a pickled trainer
finds the class by name under ddp_spawn, and importing it is what imports that package)."""

from lightning.pytorch import Callback

from traceml.capture.frameworks.lightning import StepTiming


class LightningStepCallback(StepTiming, Callback):
    pass
