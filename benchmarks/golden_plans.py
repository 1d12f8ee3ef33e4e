"""Plan JSON of a fixed set of models, for checking that a refactoring changes no plan.

    python benchmarks/golden_plans.py --out /tmp/golden-before      # on the code before
    python benchmarks/golden_plans.py --out /tmp/golden-after       # on the code after
    diff -r /tmp/golden-before /tmp/golden-after                     # must print nothing

``--only NAME ...`` writes only the named cases. Each case writes ``<name>.json`` (``Plan.to_json``,
the bytes ``plan.save`` writes). Cases: the README's offline GPT on (2, 4) with cluster "cpu"; the
golden-plan tests' models (``tests/solver/test_solver.py``: data parallel when memory is ample,
Megatron under a tight budget, tied weights under a budget); the README's budget example with
offload; a pipelined plan (``pipeline="auto"``); a mesh search; bf16 mixed precision; every hand
plan; and the zoo's and Hugging Face's LLaMA-2-70B widths at a few depths on (128, 8), as
``bench_plan_time.py`` plans them (the deeper ones with the device budget binding).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import autopar  # noqa: E402
from autopar.cost.cluster import get_cluster  # noqa: E402
from autopar.ir.options import PlanOptions  # noqa: E402
from autopar.solver.planners.traced import plan_traced  # noqa: E402
from autopar.trace import trace_repeated  # noqa: E402
from autopar.zoo.models import GPT, LLAMA_SHAPES, MLPBlock, WithMSELoss, build_model, example_batch  # noqa: E402

HAND_KINDS = ("ddp", "zero1", "zero2", "fsdp", "megatron", "megatron_sp", "tp_fsdp", "ep_fsdp")


def _readme_gpt(n_layer: int = 2, batch: int = 8):
    torch.manual_seed(0)
    model = GPT(vocab_size=256, block_size=32, n_layer=n_layer, n_head=4, n_embd=64)
    idx = torch.randint(0, 256, (batch, 32))
    return model, (idx, torch.randint(0, 256, (batch, 32)))


def _meta_gpt():
    with torch.device("meta"):
        model = GPT(vocab_size=1024, block_size=128, n_layer=2, n_head=8, n_embd=256, bias=False)
        idx = torch.zeros(8, 128, dtype=torch.long)
    return model, (idx, idx)


def _mlp():
    torch.manual_seed(0)
    return WithMSELoss(MLPBlock(d=1024, hidden=4096))


def readme_gpt():
    model, batch = _readme_gpt()
    return autopar.plan(model, mesh=(2, 4), example_inputs=batch, cluster="cpu")


def data_parallel():
    with torch.device("meta"):
        model = WithMSELoss(MLPBlock(d=256, hidden=1024))
        x, y = torch.randn(1 << 20, 256), torch.randn(1 << 20, 256)
    return autopar.plan(model, (2, 4), example_inputs=(x, y), cluster="h100-80g")


def megatron_budget():
    model, x = _mlp(), torch.randn(8, 1024)
    # the replicated layout's peak, as tests/solver/test_solver.py takes it
    free = autopar.hand_plan("ddp", model, (4,), example_inputs=(x, torch.randn_like(x)), cluster="h100-80g")
    budget = 0.35 * free.predicted.peak_memory_bytes
    return autopar.plan(model, (4,), example_inputs=(x, torch.randn_like(x)), cluster="h100-80g", memory_budget=budget)


def tied_budget():
    model, batch = build_model("gpt", seed=0), example_batch("gpt", 8, seed=1)
    free = autopar.plan(model, (2, 2), example_inputs=batch)
    return autopar.plan(model, (2, 2), example_inputs=batch, memory_budget=0.25 * free.predicted.peak_memory_bytes)


def readme_offload():
    model, batch = _readme_gpt(batch=4)
    free = autopar.plan(model, (1,), example_inputs=batch, cluster="cpu")
    budget = 0.4 * free.predicted.peak_memory_bytes
    return autopar.plan(model, (1,), example_inputs=batch, cluster="cpu", memory_budget=budget, offload="auto")


def checkpointing_budget():
    model, batch = _readme_gpt(n_layer=4)
    free = autopar.plan(model, (2, 2), example_inputs=batch, cluster="cpu")
    budget = 0.6 * free.predicted.peak_memory_bytes
    return autopar.plan(model, (2, 2), example_inputs=batch, cluster="cpu", memory_budget=budget)


def pipeline_auto():
    model, batch = _readme_gpt(n_layer=4)
    return autopar.plan(model, mesh=(2, 4), example_inputs=batch, cluster="cpu", pipeline="auto", num_microbatches=4)


def pipeline_two():
    model, batch = _readme_gpt(n_layer=4)
    return autopar.plan(model, mesh=(2, 2), example_inputs=batch, cluster="cpu", pipeline=2, num_microbatches=4)


def mesh_auto():
    model, batch = _readme_gpt()
    return autopar.plan(model, mesh="auto", devices=8, example_inputs=batch, cluster="cpu")


def bf16_mixed():
    model, batch = _meta_gpt()
    return autopar.plan(model, mesh=(2, 2), example_inputs=batch, cluster="h100-80g", precision="bf16-mixed")


def hand(kind: str):
    def make():
        model, batch = _meta_gpt()
        return autopar.hand_plan(kind, model, (2, 2), example_inputs=batch, cluster="cpu")

    return make


def _traced_plan(model, args, kwargs, mesh):
    traced = trace_repeated(model, args, kwargs)
    return plan_traced(traced, mesh, get_cluster("h100-80g"), PlanOptions())


def zoo_llama(layers: int):
    def make():
        with torch.device("meta"):
            model = build_model("llama", **{**LLAMA_SHAPES["llama-2-70b"], "n_layer": layers})
            idx = torch.zeros(8, 4096, dtype=torch.long)
        return _traced_plan(model, (idx, idx), None, (128, 8))

    return make


def hf_llama(layers: int, batch: int = 8):
    def make():
        import transformers

        config = transformers.LlamaConfig(
            vocab_size=32000,
            hidden_size=8192,
            intermediate_size=28672,
            num_attention_heads=64,
            num_key_value_heads=8,
            max_position_embeddings=4096,
            num_hidden_layers=layers,
            use_cache=False,
            attn_implementation="sdpa",
        )
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
            ids = torch.zeros(batch, 4096, dtype=torch.long)
        return _traced_plan(model, (), {"input_ids": ids, "labels": ids.clone()}, (128, 8))

    return make


CASES = {
    "readme_gpt": readme_gpt,
    "data_parallel": data_parallel,
    "megatron_budget": megatron_budget,
    "tied_budget": tied_budget,
    "readme_offload": readme_offload,
    "checkpointing_budget": checkpointing_budget,
    "pipeline_auto": pipeline_auto,
    "pipeline_two": pipeline_two,
    "mesh_auto": mesh_auto,
    "bf16_mixed": bf16_mixed,
    **{f"hand_{kind}": hand(kind) for kind in HAND_KINDS},
    "zoo_llama_2": zoo_llama(2),
    "zoo_llama_48": zoo_llama(48),
    "hf_llama_2": hf_llama(2),
    "hf_llama_48": hf_llama(48),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for <case>.json")
    parser.add_argument("--only", nargs="*", choices=sorted(CASES), help="cases to write (all by default)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for name in args.only or CASES:
        start = time.perf_counter()
        plan = CASES[name]()
        with open(os.path.join(args.out, f"{name}.json"), "w") as handle:
            handle.write(plan.to_json())
        print(f"{name}: {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
