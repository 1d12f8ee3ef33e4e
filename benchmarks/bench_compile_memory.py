"""What ``autopar.compile`` adds to a process's memory while the script keeps its model.

    python benchmarks/bench_compile_memory.py [--layers 6] [--width 768]

A DDP script keeps the model it wrapped (``ddp_model = DDP(model)``), and so does
``pm = autopar.compile(model, ...)``. Where the plan holds a tensor whole (data parallel, one
device) ``pm`` holds the model's own tensor, as DDP's module does, so compile adds no copy of
the weights. One process, mesh ``(1,)``, the zoo GPT in float32 on the CPU: the weights' bytes
beside the growth of the resident set across ``compile`` (``/proc/self/statm``, after a
``gc.collect()``; tracing and planning account for the rest).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os

import torch.distributed as dist

import autopar
from autopar.zoo import build_model, example_batch


def resident_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=768)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29571")
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=120))
    config = dict(n_layer=args.layers, n_embd=args.width, n_head=12, vocab_size=32000, block_size=64)
    model = build_model("gpt", **config)
    batch = example_batch("gpt", batch_size=2, **config)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    gc.collect()
    before = resident_bytes()
    pm = autopar.compile(model, mesh=(1,), example_inputs=batch, cluster="cpu")
    gc.collect()
    grown = resident_bytes() - before
    shared = sum(p.data_ptr() == pm.local_shard(name).data_ptr() for name, p in model.named_parameters())
    print(f"weights {weights / 2**20:.0f} MiB; resident set grew {grown / 2**20:.0f} MiB across compile")
    print(f"{shared} of {len(list(model.parameters()))} parameters of the kept model are pm's own tensors")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
