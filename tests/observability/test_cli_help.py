"""`--help` as an operator reads it: every command opens with one line, in the operator's words,
saying what it is for (not the module's developer docstring), and nothing is wider than 100 columns."""

from __future__ import annotations

import importlib

import pytest

from dsv4_idxk_probe.cli import main as cli_main
from dsv4_idxk_probe.cli.main import COMMANDS, run


def _help(capsys, argv) -> str:
    with pytest.raises(SystemExit) as info:
        run(argv)
    assert info.value.code == 0
    return capsys.readouterr().out


def _description(text: str) -> list[str]:
    """The paragraph after the usage block."""
    return text.split("\n\n")[1].splitlines()


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_opens_with_an_operators_line_and_fits_100_columns(capsys, monkeypatch, command):
    monkeypatch.setenv("COLUMNS", "100")
    text = _help(capsys, [command, "--help"] if command else ["--help"])
    module = importlib.import_module(COMMANDS[command]) if command else cli_main
    first = _description(text)[0]
    assert first and len(first) <= 100, first
    docstring = (module.__doc__ or "").strip().splitlines()[0]
    assert first.strip() != docstring.strip() and not first.startswith("`"), first
    said = " ".join(" ".join(_description(text)).split())
    assert said == " ".join((module.HELP if command else cli_main.DESCRIPTION).split())
    assert [line for line in text.splitlines() if len(line) > 100] == []


@pytest.mark.parametrize("command", ["check", "demo", "install-hook", "assets"])
def test_these_commands_say_it_in_one_line(capsys, command):
    assert len(_description(_help(capsys, [command, "--help"]))) == 1
