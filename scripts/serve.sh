#!/usr/bin/env bash
# Install nanoserve (scripts/install.sh), then serve: by default the demo model on
# http://127.0.0.1:8000. Arguments go to `nanoserve serve`, e.g. scripts/serve.sh --port 9000.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec "${PYTHON:-python}" -m nanoserve.cli.main serve "$@"
