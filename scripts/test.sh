#!/usr/bin/env bash
# Install nanoserve with its test tools (scripts/install.sh dev), then run the tests (CPU only)
# in one pytest-xdist worker per core (up to 4; a test file's tests stay on one worker, so its
# servers start once). Arguments go to pytest, e.g. scripts/test.sh -k chat (-n 0: one process).
# CI runs exactly this (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh dev
exec "${PYTHON:-python}" -m pytest tests -n auto --dist loadfile "$@"
