"""traceml's terminal lines stay whole when several ranks share one stderr pipe."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

WRITER = """
import sys
from traceml import console
for i in range(int(sys.argv[2])):
    console.warn(f"rank {sys.argv[1]} line {i} " + "x" * 150, all_ranks=True)
"""
LINE = re.compile(r"traceml: rank [01] line \d+ x{150}")


@pytest.mark.parametrize("unbuffered", ["1", ""])
def test_two_processes_never_run_their_lines_together(unbuffered):
    # CI runners and schedulers often set PYTHONUNBUFFERED; print() then writes the text and
    # its newline in two system calls, and two ranks' lines interleave (seen in CI).
    env = {**os.environ, "PYTHONUNBUFFERED": unbuffered, "TRACEML": ""}
    read_end, write_end = os.pipe()
    lines_each = 400
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(rank), str(lines_each)],
            stderr=write_end,
            env=env,
        )
        for rank in (0, 1)
    ]
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        output = pipe.read().decode()
    assert [w.wait() for w in writers] == [0, 0]
    lines = output.splitlines()
    broken = [line for line in lines if not LINE.fullmatch(line)]
    assert not broken, broken[:3]
    assert len(lines) == 2 * lines_each


def test_a_closed_stderr_is_not_an_error(monkeypatch):
    from traceml import console

    class Closed:
        def write(self, _text):
            raise ValueError("I/O operation on closed file")

    monkeypatch.setattr(sys, "stderr", Closed())
    console.reset_for_tests()
    assert console.warn("nobody hears this", all_ranks=True) is False
