"""The demo model's training script: what `--code-only` leaves of a Python file."""

from __future__ import annotations

import ast
import io
import sysconfig
import tokenize
from pathlib import Path

import pytest
from scripts_loader import load_script


@pytest.fixture(scope="module")
def train_script():
    return load_script("train_demo_model")


SOURCE = '''#!/usr/bin/env python
"""Module docstring."""

import os  # a trailing comment


def f(x):
    """A docstring
    over two lines."""
    # a comment line
    y = "# not a comment"



    return x


def g():
    """The only statement: kept, or the body would be empty."""
'''


def test_strip_prose_drops_docstrings_and_comments_only(train_script):
    stripped = train_script.strip_prose(SOURCE)
    assert stripped == (
        "import os\n\n\ndef f(x):\n"
        '    y = "# not a comment"\n\n\n    return x\n\n\n'
        "def g():\n"
        '    """The only statement: kept, or the body would be empty."""\n'
    )


def test_strip_prose_leaves_unparsable_text_alone(train_script):
    assert train_script.strip_prose("def (:\n    # comment\n") == "def (:\n    # comment\n"


def without_docstrings(tree: ast.Module) -> str:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and len(body) > 1 and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                first_line = getattr(node, "lineno", 0)
                if isinstance(node, ast.Module) or body[0].lineno != first_line:
                    del body[0]
    return ast.dump(tree)


@pytest.mark.parametrize("name", ["json/decoder.py", "textwrap.py", "queue.py", "bisect.py"])
def test_strip_prose_keeps_the_code_of_real_files(train_script, name):
    text = (Path(sysconfig.get_paths()["stdlib"]) / name).read_text()
    stripped = train_script.strip_prose(text)
    tokens = tokenize.generate_tokens(io.StringIO(stripped).readline)
    assert not [token for token in tokens if token.type == tokenize.COMMENT]
    assert without_docstrings(ast.parse(stripped)) == without_docstrings(ast.parse(text))
    assert len(stripped) < len(text)
