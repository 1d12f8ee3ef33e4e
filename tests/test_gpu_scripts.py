"""The GPU run's scripts (``benchmarks/gpu_run.sh``) run end to end on a CPU at toy sizes.

A GPU is lent to few sessions and for minutes: a script that broke since the last one would cost
that run. Each part of ``gpu_run.sh`` has a dry run of the same code on a CPU (``--device cpu
--tiny``), which must exit 0 and write its results."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# gpu_run.sh's part -> (its script's dry run, what --out names in the test's folder (bench_gpu_memory's is
# a file prefix), the files it writes there)
DRY = ["--device", "cpu", "--tiny"]
PARTS = {
    "gpu_step": (["bench_gpu_step.py", *DRY], "", ["gpu_step_hf-llama_tiny.csv", "gpu_step_gpt_tiny.csv"]),
    "calibration": (["bench_calibration_gpu.py", *DRY], "", ["calibration_measured.csv", "calibration_offload.csv"]),
    "gpu_memory": (["bench_gpu_memory.py", *DRY], "gpu_memory", ["gpu_memory_tiny.csv"]),
    "gpu_memory_full": (["bench_gpu_memory.py", *DRY, "--full"], "gpu_memory", ["gpu_memory_full_tiny.csv"]),
    "selective_ac": (["bench_selective_ac.py", "--tiny"], "", ["selective_ac_cpu.json"]),
}


def test_every_part_of_the_gpu_run_has_a_dry_run_here():
    text = (ROOT / "benchmarks" / "gpu_run.sh").read_text()
    parts = text.split("PARTS=${GPU_RUN_PARTS:-", 1)[1].split("}", 1)[0].split()
    assert parts == list(PARTS)


@pytest.mark.parametrize("part", list(PARTS))
def test_the_gpu_run_part_runs_on_a_cpu(part, tmp_path):
    command, out, files = PARTS[part]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / command[0]), *command[1:], "--out", str(tmp_path / out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    written = {path.name for path in tmp_path.rglob("*") if path.is_file()}
    assert set(files) <= written, (files, sorted(written))
