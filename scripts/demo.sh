#!/usr/bin/env bash
# Set up (if needed), then train a small GPT with autopar on a 2x4 mesh of 8 gloo processes and
# check it against eager PyTorch. Extra arguments go to examples/train_gpt.py (e.g. --steps 10).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec python examples/train_gpt.py --spawn 8 --mesh 2,4 "$@"
