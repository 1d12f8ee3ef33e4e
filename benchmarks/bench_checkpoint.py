"""What checkpoint checksums cost: save and load time of the 84M GPT with and without them.

The model of ``tests/solver/memory_budget_run.py`` (an ~84M-parameter GPT, fp32), compiled on
mesh (1,) in a one-rank gloo group, with its AdamW state after one step. Each repetition saves
and loads it with checksums (``autopar.checkpoint``, as shipped: ``runtime.checksums``) and
without (DCP's plain ``FileSystemWriter``, and no verification), alternating, into a temporary
directory; the medians and their ratios are printed and written to
``benchmarks/results/bench_checkpoint.json``. CPU only; about a minute on an idle machine.

    python benchmarks/bench_checkpoint.py [--repeats 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import autopar
from autopar.runtime import checkpoint as checkpoint_module
from autopar.zoo.models import build_model

CONFIG = dict(vocab_size=8192, block_size=64, n_layer=11, n_head=12, n_embd=768, bias=False)


@contextlib.contextmanager
def without_checksums():
    """Save with DCP's plain writer and load without re-summing: the checkpoint before checksums."""
    writer, check = checkpoint_module.ChecksumWriter, checkpoint_module._check_sums
    checkpoint_module.ChecksumWriter = dcp.FileSystemWriter
    checkpoint_module._check_sums = lambda directory, metadata: None
    try:
        yield
    finally:
        checkpoint_module.ChecksumWriter, checkpoint_module._check_sums = writer, check


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write the checkpoints (a temporary directory)")
    args = parser.parse_args()
    tmp = tempfile.mkdtemp(dir=args.dir)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1, timeout=datetime.timedelta(seconds=300)
    )
    try:
        torch.manual_seed(0)
        model = build_model("gpt", **CONFIG)
        num_params = sum(p.numel() for p in model.parameters())
        batch = tuple(torch.randint(0, CONFIG["vocab_size"], (2, 64)) for _ in range(2))
        pm = autopar.compile(model, (1,), example_inputs=batch)
        optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-3)
        pm(*batch).backward()
        optimizer.step()
        times: dict[str, list[float]] = {key: [] for key in ("save_with", "save_without", "load_with", "load_without")}
        for repeat in range(args.repeats):
            for mode in ("with", "without") if repeat % 2 == 0 else ("without", "with"):
                path = Path(tmp) / f"ckpt_{mode}"
                context = without_checksums() if mode == "without" else contextlib.nullcontext()
                with context:
                    times[f"save_{mode}"].append(timed(lambda: autopar.checkpoint.save(path, pm, optimizer)))
                    times[f"load_{mode}"].append(timed(lambda: autopar.checkpoint.load(path, pm, optimizer)))
                bytes_saved = sum(f.stat().st_size for f in path.iterdir())
                shutil.rmtree(path)
        medians = {key: statistics.median(values) for key, values in times.items()}
        result = {
            "model": f"GPT {CONFIG}",
            "num_params": num_params,
            "checkpoint_bytes": bytes_saved,
            "repeats": args.repeats,
            "median_s": medians,
            "save_ratio": medians["save_with"] / medians["save_without"],
            "load_ratio": medians["load_with"] / medians["load_without"],
            "load_average": os.getloadavg(),
            "torch": torch.__version__,
        }
        print(json.dumps(result, indent=1))
        out = Path(__file__).parent / "results" / "bench_checkpoint.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
    finally:
        dist.destroy_process_group()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
