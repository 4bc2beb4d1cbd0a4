"""Argument mistakes as one line with what was probably meant, not argparse's whole usage.

argparse answers a typo with the command's usage (43 lines for `serve`) before the one line
that matters. Every `nanoserve` parser prints only that line (a bad choice's names the allowed
values), and for an unknown flag the one meant when one is close to what was typed:

    nanoserve serve: error: unrecognized arguments: --modle (did you mean --model?)
    nanoserve serve: error: argument --dtype: invalid choice: 'float64' (choose from 'auto', ...)

`--help` still prints the whole usage.
"""

from __future__ import annotations

import argparse
import difflib
from typing import NoReturn

UNRECOGNIZED = "unrecognized arguments: "
# How alike a typo and a flag must be to be suggested (difflib's ratio, 0 to 1).
SIMILARITY_CUTOFF = 0.6


def closest(word: str, candidates: list[str], cutoff: float = SIMILARITY_CUTOFF) -> str | None:
    """The candidate most like `word`, if one is alike enough and more alike than every other
    (of two that tie, neither is suggested)."""
    ratios = sorted(
        ((difflib.SequenceMatcher(None, word, c).ratio(), c) for c in candidates), reverse=True
    )
    if not ratios or ratios[0][0] < cutoff:
        return None
    if len(ratios) > 1 and ratios[1][0] == ratios[0][0]:
        return None
    return ratios[0][1]


class OneLineArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr and exit code 2, naming the flag
    meant when one is close. Subparsers made from it are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {self._with_suggestions(message)}\n")

    def _with_suggestions(self, message: str) -> str:
        if not message.startswith(UNRECOGNIZED):
            return message
        flags = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
        typed = [word.split("=")[0] for word in message[len(UNRECOGNIZED) :].split()]
        meant = {w: closest(w, flags) for w in typed if w.startswith("--") and w not in flags}
        hints = [f"did you mean {flag}?" for flag in meant.values() if flag is not None]
        if hints:
            return f"{message} ({'; '.join(hints)})"
        return f"{message} ({self.prog} --help lists them)"
