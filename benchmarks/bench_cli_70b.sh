#!/usr/bin/env bash
# LLaMA-2-70B on h100-80g, offline: plan for 1,024 and for 512 devices, then show, explain, diff
# and check both plans (the check runs one rank's rewritten forward at the full world size on a
# fake process group). Everything is on the meta device; no accelerator or process group is used.
#
#   bash benchmarks/bench_cli_70b.sh                 # the full model (slow: see benchmarks/README.md)
#   NUM_LAYERS=2 bash benchmarks/bench_cli_70b.sh    # the same flow on two layers of the real widths
#
# Settings (environment): MESH_1024 (default 128x8: data parallel across nodes, 8-way inside a
# node), MESH_512 (64x8), BATCH (global batch in sequences, 128: 0.5M tokens; more does not fit
# without activation checkpointing), SEQ (4096), BUDGET (70GiB per
# device), NUM_LAYERS (80), TIME_LIMIT (solver seconds, 600), OUT (benchmarks/results/cli_70b),
# PYTHON (python).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${OUT:-benchmarks/results/cli_70b}
MESH_1024=${MESH_1024:-128x8}
MESH_512=${MESH_512:-64x8}
LAYERS=()
if [ -n "${NUM_LAYERS:-}" ]; then LAYERS=(--num-layers "$NUM_LAYERS"); fi
COMMON=(--cluster h100-80g --batch-size "${BATCH:-128}" --seq-len "${SEQ:-4096}"
        --memory-budget "${BUDGET:-70GiB}" --time-limit "${TIME_LIMIT:-600}" "${LAYERS[@]}")
mkdir -p "$OUT"
: > "$OUT/timings.txt"

step() {  # step NAME COMMAND...: run, keep stdout in $OUT/NAME.txt, record wall seconds
    local name=$1; shift
    local start end
    start=$(date +%s.%N)
    "$@" > "$OUT/$name.txt"
    end=$(date +%s.%N)
    printf '%-14s %8.1f s\n' "$name" "$(echo "$end - $start" | bc)" | tee -a "$OUT/timings.txt"
}

step plan_1024 "$PY" -m autopar plan llama-2-70b --mesh "$MESH_1024" "${COMMON[@]}" --out "$OUT/plan_1024.json"
step plan_512 "$PY" -m autopar plan llama-2-70b --mesh "$MESH_512" "${COMMON[@]}" --out "$OUT/plan_512.json"
step show_1024 "$PY" -m autopar show "$OUT/plan_1024.json"
step html_1024 "$PY" -m autopar show "$OUT/plan_1024.json" --html "$OUT/plan_1024.html"
step explain_up "$PY" -m autopar explain "$OUT/plan_1024.json" model.layers.1.mlp.up_proj.weight
step explain_head "$PY" -m autopar explain "$OUT/plan_1024.json" lm_head.weight
step diff "$PY" -m autopar diff "$OUT/plan_512.json" "$OUT/plan_1024.json"
step check_1024 "$PY" -m autopar check "$OUT/plan_1024.json" --rank 1023
step check_512 "$PY" -m autopar check "$OUT/plan_512.json" --rank 300
ls -la "$OUT"
