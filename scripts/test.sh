#!/usr/bin/env bash
# Install nanoserve with its test tools (scripts/install.sh dev), then run the tests (CPU only).
# Arguments go to pytest, e.g. scripts/test.sh -k chat. CI runs exactly this (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh dev
exec "${PYTHON:-python}" -m pytest tests "$@"
