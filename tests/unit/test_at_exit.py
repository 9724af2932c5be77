"""When the exit handler's report comes early: an interactive session (at_exit.interactive)."""

from __future__ import annotations

import sys
import types

from traceml.capture import at_exit


def test_a_script_is_not_interactive():
    assert sys.flags.interactive == 0 and not hasattr(sys, "ps1")  # pytest's own process
    assert at_exit.interactive() is False


def test_the_prompt_and_an_ipython_kernel_are_interactive(monkeypatch):
    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)
    assert at_exit.interactive() is True
    monkeypatch.delattr(sys, "ps1")
    shell = types.SimpleNamespace(get_ipython=lambda: object())  # a kernel's running shell
    monkeypatch.setitem(sys.modules, "IPython", shell)
    assert at_exit.interactive() is True


def test_ipython_imported_by_a_script_is_not_a_prompt(monkeypatch):
    for get_ipython in (lambda: None, lambda: 1 / 0):  # no shell running; a broken one
        monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=get_ipython))
        assert at_exit.interactive() is False
    monkeypatch.setitem(sys.modules, "IPython", None)  # blocked from import
    assert at_exit.interactive() is False
