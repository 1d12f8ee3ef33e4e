#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
# The layers of autopar/ (docs/architecture.md): each folder imports only from those below it, no cycles.
lint-imports --no-cache
exec python -m pytest tests "$@"
