"""The command line's --help: every option that has a default shows it, in every subcommand.

The options are read from the parser itself (not a list kept here), so a flag added later is checked too.
"""

from __future__ import annotations

import argparse

import pytest

from beamsearch.cli.flags import build_parser


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def shown_default(action: argparse.Action) -> str | None:
    """The default --help should show for this option, or None where there is nothing to show: no default (the
    model's generation_config decides), an off switch (store_true's False), an empty list of a repeatable flag."""
    default = action.default
    if not action.option_strings or default in (None, False, argparse.SUPPRESS) or default == []:
        return None
    return " ".join(map(str, default)) if isinstance(default, list) else str(default)


def help_of(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The lines --help prints for one option (its flags and help text), whitespace collapsed."""
    formatter = parser._get_formatter()
    formatter.add_argument(action)
    return " ".join(formatter.format_help().split())


def test_every_subcommand_is_checked():
    assert {"decode", "eval", "trace"} <= set(subcommands())


@pytest.mark.parametrize("command", sorted(subcommands()))
def test_every_default_is_in_the_help(command):
    parser = subcommands()[command]
    checked, missing = 0, []
    for action in parser._actions:
        default = shown_default(action)
        if default is None:
            continue
        checked += 1
        text = help_of(parser, action)
        if f"default: {default})" not in text:
            missing.append(f"{'/'.join(action.option_strings)} (default {default!r}): {text!r}")
    assert checked > 0
    assert not missing, f"beamsearch {command} --help does not show these defaults: {missing}"


def test_the_check_finds_an_option_whose_default_is_not_shown():
    """The check above on a planted option with a default and no help text (as --batch-type was)."""
    parser = subcommands()["decode"]
    action = parser.add_argument("--planted", choices=("a", "b"), default="a")
    assert shown_default(action) == "a"
    assert "default: a)" not in help_of(parser, action)
