"""Every command's --help states each option's default exactly once."""

from __future__ import annotations

import argparse

import pytest

from nanoserve.bench.arguments import build_parser as build_bench_parser
from nanoserve.cli.help_format import DefaultsHelpFormatter
from nanoserve.cli.main import build_parser


def undocumented_defaults(parser: argparse.ArgumentParser) -> list[str]:
    """Options (switches aside) whose help does not state a default exactly once."""
    formatter = parser._get_formatter()
    missing = []
    for action in parser._actions:
        if not action.option_strings or action.nargs == 0 or action.help == argparse.SUPPRESS:
            continue
        text = formatter._expand_help(action) if action.help else ""
        if text.count("default") != 1:
            missing.append(f"{action.option_strings[-1]}: {text!r}")
    return missing


def subcommand(name: str) -> argparse.ArgumentParser:
    return build_parser()._subparsers._group_actions[0].choices[name]


@pytest.mark.parametrize("name", ["serve", "chat"])
def test_nanoserve_commands_show_every_default_once(name: str) -> None:
    assert undocumented_defaults(subcommand(name)) == []


def test_bench_shows_every_default_once() -> None:
    assert undocumented_defaults(build_bench_parser()) == []


def test_the_formatter_appends_a_default_only_when_the_help_has_none() -> None:
    parser = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--a", default=3, help="a number")
    parser.add_argument("--b", help="a name (default: the model's)")
    parser.add_argument("--c", action="store_true", help="a switch")
    text = " ".join(parser.format_help().split())
    assert "a number (default: 3)" in text and "(default: the model's)" in text
    assert text.count("default") == 2
