"""A slow interconnect, for the test scripts: every DDP model built from now on gets a
communication hook (the user's own, as far as traceml is concerned) that sleeps before each
bucket's all-reduce."""

from __future__ import annotations

import time


def install_slow_comm_hook(delay_s: float) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    def slow_network(state, bucket):
        time.sleep(delay_s)
        return allreduce_hook(state, bucket)

    original_init = DistributedDataParallel.__init__

    def init_with_hook(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.register_comm_hook(None, slow_network)

    DistributedDataParallel.__init__ = init_with_hook
