"""Rewrite dev-constraints.txt: the versions pip resolves today for the test tools (pyproject's
`dev` extras) and for every package only they bring in. Runtime dependencies stay ranges.

    python scripts/refresh_dev_pins.py                 # keeps the holds the file names
    python scripts/refresh_dev_pins.py 'pytest<9.2'    # holds a tool back (replaces them)

Then run CI (`CI=true bash .ci/run`, a fresh virtual environment) and commit the file if it
passes; if two new releases fail together, hold one back and run this again.

Nothing is installed: pip resolves twice with `--dry-run` (about two minutes, from the index),
once for `.[dev]` and once for `.`, and the pins are what the first has and the second does not.
torch is asked for as scripts/install.sh installs it, so pip never resolves another one.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PINS = ROOT / "dev-constraints.txt"
TORCH = "torch==2.13.0"  # as scripts/install.sh installs it
HOLDS_LINE = "# holds: "
HEADER = """\
# The test tools (pyproject's dev extras) and the packages only they need, at versions known to
# pass the suite together. `scripts/install.sh dev` installs with `pip install -c` this file.
# Written by `python scripts/refresh_dev_pins.py [HOLD ...]`; the README says how to refresh it.
"""


def canonical(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def resolve(requirements: list[str]) -> dict[str, str]:
    """Name -> version of everything pip would install for `requirements` in an empty
    environment (a dry run: nothing is installed)."""
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed"]
    command += ["--quiet", "--report", "-", TORCH, *requirements]
    done = subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True)
    report = json.loads(done.stdout)
    return {
        canonical(item["metadata"]["name"]): item["metadata"]["version"]
        for item in report["install"]
    }


def dev_only_pins(holds: list[str]) -> dict[str, str]:
    """The packages `.[dev]` (with `holds`) installs that `.` alone does not, with versions."""
    everything = resolve(["-e", ".[dev]", *holds])
    runtime = resolve(["-e", "."])
    return {name: everything[name] for name in sorted(everything) if name not in runtime}


def holds_in(pins_file: Path) -> list[str]:
    """The holds a previous run wrote down (`# holds: pytest<9.2 ...`)."""
    if not pins_file.exists():
        return []
    for line in pins_file.read_text().splitlines():
        if line.startswith(HOLDS_LINE):
            return line.removeprefix(HOLDS_LINE).split()
    return []


def main(argv: list[str]) -> int:
    holds = argv or holds_in(PINS)
    pins = dev_only_pins(holds)
    lines = [HEADER.rstrip("\n"), HOLDS_LINE + " ".join(holds) if holds else "# holds: (none)"]
    lines += [f"{name}=={version}" for name, version in pins.items()]
    PINS.write_text("\n".join(lines) + "\n")
    print(f"{PINS.name}: {len(pins)} pins, holds: {' '.join(holds) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
