"""What turning a traced causal mask back into ``is_causal=True`` buys (``autopar.trace.attention``).

    python benchmarks/bench_causal_mask.py                 # one GPU, a few minutes
    python benchmarks/bench_causal_mask.py --full          # the issue's LLaMA-3-8B widths, 4 layers
    python benchmarks/bench_causal_mask.py --device cpu --tiny   # a dry run of the script here

One process, one device, a process group of one rank (NCCL on CUDA, gloo on a CPU). A Hugging
Face ``LlamaForCausalLM`` from a config (``sdpa`` attention, bfloat16 on a GPU) takes forward and
backward steps (``labels=input_ids``, no optimizer: the step that attention changes) under three
trainers of the same weights:

- ``eager``: the model as it is (Hugging Face calls SDPA with ``is_causal=True``, no mask);
- ``autopar``: ``autopar.compile(model, mesh=(1,))``, whose trace turns the mask back;
- ``autopar_masked``: the same with the pass switched off, so SDPA gets the traced mask (what
  autopar ran before the pass);
- ``eager_attention_mask``, ``autopar_attention_mask``: eager and autopar called with an
  ``attention_mask`` of ones, as ``Trainer`` passes for unpadded batches: the traced mask is built
  from it, and each call checks it (``autopar.ops.causal_mask``), as eager checks it.

For each: how many SDPA calls one forward makes and how many pass a mask (recorded with a
``TorchFunctionMode``), the median step time over ``--repeat`` steps (CUDA events; wall time on a
CPU) and the ratio to eager, and the peak memory of a step on a GPU. Writes ``causal_mask.csv``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F
from bench_gpu import one_rank, time_cuda, write_csv
from torch.overrides import TorchFunctionMode

import autopar

SDPA = torch.ops.aten.scaled_dot_product_attention.default


class _SdpaCalls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.masks: list[bool] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention or func is SDPA:
            self.masks.append(kwargs.get("attn_mask", args[3] if len(args) > 3 else None) is not None)
        return func(*args, **kwargs)


def _config(tiny: bool, full: bool):
    """(config keywords, batch, sequence)."""
    if tiny:
        return (
            dict(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=256,
            ),
            2,
            64,
        )
    if full:  # the row: LLaMA-3-8B widths, 4 layers, batch 2 x 4096
        return (
            dict(
                hidden_size=4096,
                intermediate_size=14336,
                num_hidden_layers=4,
                num_attention_heads=32,
                num_key_value_heads=8,
                vocab_size=128256,
            ),
            2,
            4096,
        )
    return (
        dict(
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=2,
            num_attention_heads=16,
            num_key_value_heads=4,
            vocab_size=32000,
        ),
        2,
        4096,
    )


def _model(device: torch.device, tiny: bool, full: bool):
    import transformers  # optional dependency: only this benchmark needs it

    keywords, batch, seq = _config(tiny, full)
    config = transformers.LlamaConfig(
        **keywords,
        max_position_embeddings=seq,
        attn_implementation="sdpa",
        use_cache=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(dtype).train()
    ids = torch.randint(3, config.vocab_size, (batch, seq), device=device)
    return model, {"input_ids": ids, "labels": ids.clone()}


def _time(step, device: torch.device, repeat: int) -> float:
    if device.type == "cuda":
        return time_cuda(step, warmup=2, repeat=repeat)
    step()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _measure(name: str, module: torch.nn.Module, kwargs: dict, device: torch.device, repeat: int) -> dict:
    def step():
        module.zero_grad(set_to_none=True)
        module(**kwargs).loss.backward()

    with _SdpaCalls() as calls:
        module(**kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    seconds = _time(step, device, repeat)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if device.type == "cuda" else float("nan")
    row = {"trainer": name, "sdpa_calls": len(calls.masks), "masked_calls": sum(calls.masks), "step_ms": round(seconds * 1e3, 3)}
    row["peak_gib"] = round(peak, 3)
    print(
        f"{name:15s} sdpa {row['sdpa_calls']} (masked {row['masked_calls']})  step {row['step_ms']:.2f} ms  peak {peak:.2f} GiB",
        flush=True,
    )
    return row


def run(device: torch.device, tiny: bool, full: bool, repeat: int, out: Path) -> list[dict]:
    model, kwargs = _model(device, tiny, full)
    rows = [_measure("eager", copy.deepcopy(model), kwargs, device, repeat)]
    compiled = autopar.compile(copy.deepcopy(model), (1,), example_kwargs=kwargs)  # priced for this machine
    rows.append(_measure("autopar", compiled, kwargs, device, repeat))
    del compiled
    with mock.patch("autopar.trace.export.causal_attention", lambda gm, constants=None: 0):
        masked = autopar.compile(copy.deepcopy(model), (1,), example_kwargs=kwargs)
    rows.append(_measure("autopar_masked", masked, kwargs, device, repeat))
    del masked
    padded = {**kwargs, "attention_mask": torch.ones_like(kwargs["input_ids"])}
    rows.append(_measure("eager_attention_mask", copy.deepcopy(model), padded, device, repeat))
    from_batch = autopar.compile(copy.deepcopy(model), (1,), example_kwargs=padded)
    rows.append(_measure("autopar_attention_mask", from_batch, padded, device, repeat))
    eager_s = rows[0]["step_ms"]
    for row in rows:
        row["vs_eager"] = round(row["step_ms"] / eager_s, 3)
    write_csv(out / "causal_mask.csv", rows)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="a tiny model: a dry run of the script on a CPU")
    parser.add_argument("--full", action="store_true", help="the issue's LLaMA-3-8B widths, 4 layers")
    parser.add_argument("--repeat", type=int, default=8)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"), help="folder for the CSV")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    with one_rank(device, "29541"):
        rows = run(device, args.tiny, args.full, args.repeat, Path(args.out))
    return 0 if rows[1]["masked_calls"] == rows[-1]["masked_calls"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
