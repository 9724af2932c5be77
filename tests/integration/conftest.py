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
