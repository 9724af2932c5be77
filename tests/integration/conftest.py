import fnmatch

import pytest

# The slowest real-model matrix (issue 21): still run by the README's test command and CI;
# `bash scripts/test.sh -m "not slow"` leaves it out for a quicker loop while working
# (docs/testing.md). By test node id (fnmatch), each with what makes it slow.
SLOW = {
    "test_fault_injection.py::*": "~60 real trainings, one per broken entry point",
    "test_distributed.py::*": "RF-DETR and Lightning under torchrun, 2-4 ranks",
    "test_transparency.py::test_traced_exactly_as_untraced*": "every group untraced and traced",
    "test_examples.py::*": "the documented examples, several epochs each",
    "test_overhead_ratio.py::*": "three rounds of plain vs traced",
    "test_rfdetr.py::*": "RF-DETR training, evaluation, export and the demo",
    "test_dataloader_timing.py::test_rfdetr_*": "RF-DETR with DataLoader workers",
}


def pytest_collection_modifyitems(items):
    for item in items:
        if "/integration/" not in str(item.fspath):
            continue
        item.add_marker(pytest.mark.integration)
        node = f"{item.path.name}::{item.name}"  # a parameter may hold a "/" itself
        if any(fnmatch.fnmatchcase(node, pattern) for pattern in SLOW):
            item.add_marker(pytest.mark.slow)


class DirectDDPRun:
    """A finished direct launch under torchrun (2 gloo ranks), shared by the tests that read it.

    Readers must not write into ``run_dir`` (another test reads it too): copy it first.
    """

    def __init__(self, result, run_dir) -> None:
        self.result = result
        self.run_dir = run_dir


@pytest.fixture(scope="session")
def direct_ddp_run(tmp_path_factory) -> DirectDDPRun:
    """``TRACEML=1 torchrun --nproc-per-node 2 tiny_lightning.py`` with the default run name and
    the report at exit: 40 optimizer steps per rank of ~20 ms (a balanced run whose gloo
    all-reduce is a small share of the step, as in real training). One run for the launcher's
    direct-launch test, the balanced DDP verdicts and the per-node partials (issue 21: each
    torchrun costs three Lightning imports)."""
    import shutil

    from procs import TINY, clean_env, only_run_dir, run, torchrun_2

    tmp = tmp_path_factory.mktemp("direct_ddp")
    script = tmp / TINY.name
    shutil.copy(TINY, script)
    env = clean_env(
        TRACEML="1",
        TRACEML_LOGS_DIR=tmp / "logs",
        TINY_VALIDATE=0,
        TINY_BATCHES=80,
        TINY_STEP_SLEEP_MS=20,
    )
    result = run(torchrun_2(script), env, tmp, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return DirectDDPRun(result, only_run_dir(tmp / "logs"))
