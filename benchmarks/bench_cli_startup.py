"""Start-up time of the command line: ``python -m autopar --help`` and each subcommand's ``--help``.

    python benchmarks/bench_cli_startup.py [--runs 5] [--out benchmarks/results/cli_startup.csv]

Each command runs ``--runs`` times in a fresh interpreter; the table gives the median and the best
wall-clock seconds, beside ``python -c pass`` (the interpreter's own start-up) measured in the
same run. The target is under 1 s: help loads argparse and the CLI, never torch. The last column
says whether torch was imported (``-X importtime``), which is what made help slow before.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {
    "python -c pass": ["-c", "pass"],
    "autopar --help": ["-m", "autopar", "--help"],
    "autopar plan --help": ["-m", "autopar", "plan", "--help"],
    "autopar show --help": ["-m", "autopar", "show", "--help"],
    "autopar diff --help": ["-m", "autopar", "diff", "--help"],
    "autopar check --help": ["-m", "autopar", "check", "--help"],
}


def time_command(args: list[str], runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, *args], cwd=ROOT, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return times


def imports_torch(args: list[str]) -> bool:
    result = subprocess.run([sys.executable, "-X", "importtime", *args], cwd=ROOT, capture_output=True, text=True)
    return any(line.rstrip().endswith("| torch") for line in result.stderr.splitlines())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="also write the rows as CSV")
    args = parser.parse_args()
    rows = []
    for label, command in COMMANDS.items():
        times = time_command(command, args.runs)
        rows.append(
            {
                "command": label,
                "median_s": round(statistics.median(times), 3),
                "best_s": round(min(times), 3),
                "imports_torch": imports_torch(command),
            }
        )
    width = max(len(row["command"]) for row in rows)
    print(f"{'command':<{width}}  median s  best s  torch")
    for row in rows:
        print(
            f"{row['command']:<{width}}  {row['median_s']:>8.3f}  {row['best_s']:>6.3f}  "
            f"{'yes' if row['imports_torch'] else 'no'}"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
