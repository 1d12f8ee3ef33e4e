#!/usr/bin/env bash
# Every GPU measurement the open issues ask for, in one bounded run on one GPU (at most about 10
# minutes on an H200), each script under its own time limit so that one failure or overrun costs only its
# part. Results and logs go to DIR (default benchmarks/results/h200); the last lines of each log
# are printed.
#
#     bash benchmarks/gpu_run.sh [DIR]
#     GPU_RUN_PARTS="gpu_step calibration" bash benchmarks/gpu_run.sh   # only these parts
set -u
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/h200}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PARTS=${GPU_RUN_PARTS:-gpu_step calibration gpu_memory gpu_memory_full selective_ac}
python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))"

part() {  # part NAME SECONDS SCRIPT ARGS...
    local name=$1 seconds=$2 start=$SECONDS
    shift 2
    case " $PARTS " in *" $name "*) ;; *) return ;; esac
    echo "=== $name (at most $seconds s)"
    timeout "$seconds" python3 "$@" >"$OUT/$name.log" 2>&1
    echo "=== $name: exit $? after $((SECONDS - start)) s"
    grep -v -i -e warn -e '^\s*$' "$OUT/$name.log" | tail -n 20
}

part gpu_step 135 benchmarks/bench_gpu_step.py --minutes 1.9 --out "$OUT" --profile "$OUT"      # issue 43
part calibration 80 benchmarks/bench_calibration_gpu.py --quick --out "$OUT"                    # issue 44
part gpu_memory 100 benchmarks/bench_gpu_memory.py --max-minutes 1.4 --out "$OUT/gpu_memory"    # issue 48
part gpu_memory_full 210 benchmarks/bench_gpu_memory.py --full --max-minutes 3.2 --out "$OUT/gpu_memory"  # issue 48
part selective_ac 100 benchmarks/bench_selective_ac.py --out "$OUT"                             # issue 48
