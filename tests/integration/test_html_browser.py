"""report.html in a real headless Chromium: it loads and renders (a screenshot is taken).

Skipped cleanly when no Chromium is installed (Debian: apt-get install chromium).
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from traceml.finalize import summarise

from rankfiles import synthetic_run

BROWSER = next(
    (
        shutil.which(name)
        for name in ("chromium", "chromium-browser", "google-chrome")
        if shutil.which(name)
    ),
    None,
)


@pytest.mark.skipif(BROWSER is None, reason="no Chromium installed")
def test_report_html_renders_in_headless_chromium(tmp_path):
    synthetic_run(tmp_path / "run", ranks=2, steps=60, input=40, forward=30, backward=30)
    summarise(tmp_path / "run", html=True)
    page = tmp_path / "run" / "report.html"
    shot = tmp_path / "report.png"
    result = subprocess.run(
        [
            BROWSER,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--window-size=1200,1600",
            f"--screenshot={shot}",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000  # a rendered page, not a blank
