"""The reducer's worker processes (``--jobs``): every way of ending ends."""

from __future__ import annotations

import subprocess
import sys

import pytest

from traceml.analysis.workers import pool_map

# One task fails while the others send large results: the failure stops the workers, some in
# the middle of a send. With concurrent.futures' pool that left half a message in its result
# pipe and the pool's thread (then the report, then the interpreter's exit) waited for the
# rest forever: 16 runs in 20 hung (helper review).
STOPPED_MID_SEND = """
import sys, time
from traceml.analysis.workers import pool_map

def work(index):
    if index == 5:
        time.sleep(0.05)
        raise ValueError("refused")
    return b"x" * 20_000_000

if __name__ == "__main__":
    for _ in range(5):
        try:
            for _result in pool_map(2, work, range(16)):
                pass
        except ValueError as exc:
            print("raised", exc, flush=True)
"""


def test_a_failure_while_workers_send_ends_with_the_failure(tmp_path):
    script = tmp_path / "stopped.py"
    script.write_text(STOPPED_MID_SEND)
    try:
        done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("pool_map hung after a task failed while other workers sent results")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["raised refused"] * 5
    assert done.stderr == ""  # no thread's traceback, no 'Exception ignored'


def _square_or_fail(value: int) -> int:
    if value < 0:
        raise KeyError(value)
    return value * value


def test_results_come_in_order_and_a_failure_is_raised_as_it_was():
    assert list(pool_map(3, _square_or_fail, range(10))) == [v * v for v in range(10)]
    assert list(pool_map(2, divmod, [7, 9], [2, 4])) == [(3, 1), (2, 1)]
    assert list(pool_map(2, _square_or_fail, [])) == []
    found = pool_map(2, _square_or_fail, [1, 2, -3, 4])
    assert next(found) == 1 and next(found) == 4
    with pytest.raises(KeyError):
        next(found)
