"""RF-DETR Nano at test size (tests/integration/scripts/rfdetr_train.py), for
benchmarks/compare_gate.py. GATE_SLOW_MS adds that many milliseconds to every AdamW step: a
real regression of the training, not of the numbers (the optimizer really takes longer)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration" / "scripts"))

import rfdetr_train  # after the path it lives on

SLOW_S = float(os.environ.get("GATE_SLOW_MS", "0")) / 1000.0

if SLOW_S > 0:
    import torch

    original_step = torch.optim.AdamW.step

    def slower_step(self, *args, **kwargs):
        time.sleep(SLOW_S)
        return original_step(self, *args, **kwargs)

    torch.optim.AdamW.step = slower_step

if __name__ == "__main__":
    sys.exit(rfdetr_train.main())
