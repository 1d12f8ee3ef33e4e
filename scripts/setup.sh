#!/usr/bin/env bash
# Create .venv and install autopar with its test extras. Safe to run again.
# torch is installed first and pinned to the CPU build that this project's machines carry;
# on a machine that already has a torch in the venv (a GPU build, say) it is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
# Some machines' pip configuration names local index folders that do not exist; pip warns about
# each one on every install. Drop just those lines; everything else (errors too) passes through.
quiet_pip() {
    python -m pip install -q "$@" 2> >(grep -v "^WARNING: Location 'file:" >&2)
}
if ! python -c "import torch" 2>/dev/null; then
    quiet_pip "torch==${AUTOPAR_TORCH_VERSION:-2.13.0}"
fi
quiet_pip -e ".[dev]"
python -c "import torch, pulp, autopar; print(f'autopar ready: torch {torch.__version__}, pulp {pulp.__version__}')"
