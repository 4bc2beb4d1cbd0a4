"""The arguments of `nanoserve serve` that name the model, as vLLM users type them.

`nanoserve serve MODEL` or `--model MODEL` (not both); `--tokenizer`, `--revision` and
`--download-dir` reach the hub as in vLLM; `--trust-remote-code` is accepted and does nothing,
because nanoserve never runs code from a checkpoint.
"""

from __future__ import annotations

import argparse


def add_hub_flags(parser: argparse.ArgumentParser) -> None:
    """--tokenizer, --revision, --download-dir and --trust-remote-code, as vLLM has them."""
    parser.add_argument(
        "--tokenizer", help="tokenizer directory or hub id (default: the model's own tokenizer)"
    )
    parser.add_argument(
        "--revision", help="hub branch, tag or commit of --model (default: the main branch)"
    )
    parser.add_argument(
        "--download-dir", help="where hub downloads are cached (default: huggingface_hub's cache)"
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted for vLLM compatibility; it has no effect: nanoserve runs its own model "
        "code and never code from a checkpoint",
    )


def check_model_arguments(
    parser: argparse.ArgumentParser, args: argparse.Namespace, serve_argv: list[str]
) -> None:
    """The model is given once, and a value after a flag that takes none is not taken for it."""
    if args.model_pos is None:
        return
    if args.model is not None:
        parser.error(
            f"the model is given twice ({args.model_pos!r} and --model {args.model!r}); give one"
        )
    actions = parser._actions
    valueless = {flag for action in actions if action.nargs == 0 for flag in action.option_strings}
    for previous, token in zip(serve_argv, serve_argv[1:], strict=False):
        if token == args.model_pos and previous in valueless:
            parser.error(
                f"{previous} takes no value, got {token!r}; if {token!r} is the model, put it "
                f"first: nanoserve serve {token} {previous}"
            )
