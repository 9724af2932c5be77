"""Every command describes itself and every option has help text and a line in docs/cli.md
(issue 25)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from traceml.cli import build_parser

DOCS = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def options(command: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        a
        for a in command._actions
        if not isinstance(a, argparse._HelpAction) and a.help != argparse.SUPPRESS
    ]


@pytest.mark.parametrize("name", ["run", "report", "watch", "compare"])
def test_every_command_has_a_description_and_every_option_help(name):
    command = commands()[name]
    assert command.description, f"traceml {name} --help has no description"
    missing = [a.option_strings or [a.dest] for a in options(command) if not a.help]
    assert missing == [], f"traceml {name}: options without help: {missing}"


@pytest.mark.parametrize("name", ["run", "report", "watch", "compare"])
def test_every_option_is_in_the_docs(name):
    text = DOCS.read_text()
    assert f"## traceml {name}" in text
    section = text.split(f"## traceml {name}", 1)[1].split("\n## ", 1)[0]
    for action in options(commands()[name]):
        for flag in action.option_strings:
            assert f"`{flag}" in section, f"{flag} of traceml {name} is not in docs/cli.md"
