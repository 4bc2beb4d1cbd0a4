"""The help format of every `nanoserve` command: each option's default, shown once."""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help unless the help already says its default,
    the option takes no value (a switch is off by default) or it has no default value."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        default = action.default
        if "default" in help_text or default in (None, argparse.SUPPRESS) or action.nargs == 0:
            return help_text
        if default in ("", [], {}):
            return f"{help_text} (default: none)".lstrip()
        return f"{help_text} (default: %(default)s)".lstrip()
