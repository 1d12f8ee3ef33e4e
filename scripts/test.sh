#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
# The layers of autopar/ (docs/architecture.md): each folder imports only from those below it, no cycles.
lint-imports --no-cache
# Lint (pyproject.toml [tool.ruff.lint]): unused and undefined names, bugbear, import order, pyupgrade, simplify.
ruff check -q autopar tests benchmarks scripts examples
# One code format (pyproject.toml [tool.ruff.format]); `ruff format autopar tests benchmarks scripts examples` fixes it.
ruff format --check -q autopar tests benchmarks scripts examples
# Two workers (pytest-xdist), one test file at a time each, so that a module's fixtures are built
# once; tests/conftest.py starts the slowest files first. AUTOPAR_TEST_WORKERS=0 runs in one process.
exec python -m pytest -n "${AUTOPAR_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder tests "$@"
