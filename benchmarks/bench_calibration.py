"""The cost model against every measured GPU run we have and published runs (issue 44).

    python benchmarks/bench_calibration.py [--rows NAME ...] [--cluster FILE] [--out CSV] [--layout KIND]

Each row is one training job whose step time (or tokens/s) and peak memory were measured, on
our H200 and H100 (``benchmarks/results/gpu_step.csv``, ``gpu_compiled_*.csv``, issues 43/44)
or published with exact settings (torchtitan's ``benchmarks/llama3_h100_202412_torchtitan.md``,
Megatron-LM's H100 GPT table, llm-foundry's MPT table: ``MEGATRON_ROWS``, ``MPT_ROWS``).
The job is planned offline on the meta device, on the row's preset (``h200-141g``; H100 rows on
``h100-80g`` with the H200's achieved rates, the same Hopper kernels; ``--cluster FILE``: a
spec from ``autopar profile`` for the H200 rows instead), laid out as measured (``layout``: a
hand plan, or ``plan``: what ``autopar.plan`` picks), and priced:

* predicted step = the plan's ``step_time_s`` (forward + backward + exposed communication +
  memory decisions + torch's default AdamW step, ``predicted.optimizer_s``), without the AdamW
  step where the measured figure has none, with the fused one (``cost.rates.optimizer_step_s``)
  where the run stepped that;
* predicted peak = what the run measured (``measured_memory``): the plan's ``peak_memory_bytes``
  (tensors allocated) for ``torch.cuda.max_memory_allocated``, or the caching allocator's
  reserved peak (``predicted.allocator_peak_bytes``, ``solver.pricing.reserved``; under the
  allocator the run used) for ``max_memory_reserved``. Both are in the CSV.

Columns: predicted and measured step seconds (tokens/s/GPU for published rows), peak GiB,
and the ratios predicted / measured. A published job is also planned by ``autopar.plan`` on the
same mesh and budget (``solver_*`` columns): its predicted step must not be slower. Rows whose
layout autopar cannot express yet say why in ``status`` (torchtitan's FSDP + op-level selective
activation checkpointing is ``hand_plan(..., checkpointing="selective-op")``).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import inspect
import math
import os
import sys
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the 405B row reuses a sibling benchmark

import autopar  # noqa: E402
from autopar.cost.cluster import ClusterSpec, get_cluster  # noqa: E402
from autopar.cost.rates import optimizer_step_s  # noqa: E402
from autopar.ir.gathers import param_layer  # noqa: E402
from autopar.ir.spec import format_spec  # noqa: E402
from autopar.solver.planners.hand_plans import megatron_placement  # noqa: E402
from autopar.zoo.models import GPT, LLAMA_SHAPES, Llama  # noqa: E402

GIB = 2**30
HF_LLAMA_3_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    num_hidden_layers=32,
)


@dataclass(frozen=True, slots=True)
class Row:
    """One measured job, ``batch`` sequences of ``seq`` tokens per GPU. ``measured_step_s`` or
    ``measured_tokens_per_s`` (per GPU) is given;
    ``with_optimizer``: the measured time includes the AdamW step."""

    name: str
    source: str
    model: str  # "gpt:L:E:H[:option...]" (``build_model``), "zoo-llama-3-8b:L", "hf-llama-3-8b:L"
    batch: float  # sequences per GPU: the global batch over the mesh (0.5: two tensor-parallel GPUs share one)
    seq: int
    mesh: tuple[int, ...]
    layout: str  # "plan" or a hand_plan kind
    preset: str
    memory_bytes: float  # the device's memory the job ran on; published rows plan with all of it as the budget
    measured_step_s: float | None = None
    measured_tokens_per_s: float | None = None
    measured_peak_gib: float | None = None
    with_optimizer: bool = True
    dtype: str = "bfloat16"  # the model's dtype (parameters, activations, AdamW state)
    precision: str | None = None
    checkpointing: str | None = None  # what the published job ran ("selective-op")
    optimizer: str = "foreach"  # AdamW's implementation (``cost.rates.OPTIMIZER_TRAFFIC``)
    published: bool = False
    # What the measured peak is: torch.cuda.max_memory_"allocated" (tensors) or "reserved" (the
    # caching allocator's segments, under PyTorch's "default" allocator or "expandable" segments).
    measured_memory: str = "allocated"
    allocator: str = "default"
    optimizer_shards: int = 1  # ranks that split each parameter's AdamW step (a distributed optimizer's data-parallel size)
    # The FSDP layers the published job kept gathered from forward to backward: "root" (FSDP2's
    # default; Composer's FULL_SHARD), or "root+last" (torchtitan: every block resharded but the last)
    kept: str = "root"
    note: str = ""  # what of the published job the priced layout leaves out, or assumes

    def __post_init__(self):
        if abs(self.global_batch - self.batch * math.prod(self.mesh)) > 1e-9:
            raise ValueError(f"row {self.name!r}: batch {self.batch} per GPU times {math.prod(self.mesh)} GPUs is no whole batch")

    @property
    def global_batch(self) -> int:
        return round(self.batch * math.prod(self.mesh))


def megatron_tokens_per_s(tflops_per_gpu: float, layers: int, hidden: int, seq: int, vocab: int) -> float:
    """Tokens/s per GPU from Megatron-LM's achieved TFLOP/s per GPU, by its own count of a GPT
    step's FLOPs (``num_floating_point_operations``, megatron/training/training.py at f2e5db402c):
    12·L·h²·(6 + s/h + V/(2·L·h)) per token for a 4h GELU MLP without GQA, attention counted
    whole (not halved for the causal mask), logits included, no recompute."""
    return tflops_per_gpu * 1e12 / (12 * layers * hidden**2 * (6 + seq / hidden + vocab / (2 * layers * hidden)))


# NVIDIA/Megatron-LM README.md "Performance Benchmarking" and its images/model_table.png (added in
# f2e5db402c, 2024-07-15, "New scaling figures on H100 GPUs"): GPT models of vocabulary 131,072
# and sequence 4,096 on H100s (NVIDIA's DGX H100 machines: the h100-80g preset), bf16, data-
# parallel size 48, with --overlap-grad-reduce, --overlap-param-gather (which need the
# distributed optimizer: AdamW state split over the 48 data-parallel ranks, as ZeRO-1) and
# --tp-comm-overlap (which needs sequence parallelism). The parameter counts (1.7B at 24 x 2048)
# are those of GPT-3's layer (12·h², biases, LayerNorm, learned positions) with an untied LM head.
# Activation recompute is not stated: priced with none, Megatron's default. Megatron steps with
# a fused Adam (Apex/Transformer Engine), bf16 parameters with fp32 main copies and gradients:
# priced as "bf16-mixed" (fp32 parameters, bf16 compute). The rows with pipeline stages (70B
# to 462B) are left out: a hand plan cannot express a pipeline yet (the 405B row's machinery,
# bench_llama405b_pipeline, prices torchtitan's alone).
MEGATRON_SOURCE = "NVIDIA/Megatron-LM README.md, images/model_table.png at f2e5db402c"
MEGATRON_GPT = "vocab=131072:block=4096:bias:untied"
MEGATRON_ZERO1_TP = (
    "no hand plan splits AdamW state over DP under TP yet: the distributed optimizer's split (48) is priced "
    "here, its step by optimizer_shards, its state as _distributed_optimizer_bytes"
)
MEGATRON_ROWS = (
    Row("megatron-lm gpt 1.7b dp48 48 gpus", MEGATRON_SOURCE + ", row 1.7B", f"gpt:24:2048:16:{MEGATRON_GPT}", 4, 4096,
        (48,), "zero1", "h100-80g", 80 * GIB, measured_tokens_per_s=megatron_tokens_per_s(408.8, 24, 2048, 4096, 131072),
        dtype="float32", precision="bf16-mixed", optimizer="fused", published=True, optimizer_shards=48,
        note="DDP with the distributed optimizer (ZeRO-1 over 48)"),
    Row("megatron-lm gpt 7.1b tp2 dp48 96 gpus", MEGATRON_SOURCE + ", row 7.1B", f"gpt:30:4096:32:{MEGATRON_GPT}", 2, 4096,
        (48, 2), "megatron_sp", "h100-80g", 80 * GIB,
        measured_tokens_per_s=megatron_tokens_per_s(465.9, 30, 4096, 4096, 131072), dtype="float32",
        precision="bf16-mixed", optimizer="fused", published=True, optimizer_shards=48, note=MEGATRON_ZERO1_TP),
    Row("megatron-lm gpt 16b tp4 dp48 192 gpus", MEGATRON_SOURCE + ", row 16B", f"gpt:32:6144:48:{MEGATRON_GPT}", 1, 4096,
        (48, 4), "megatron_sp", "h100-80g", 80 * GIB,
        measured_tokens_per_s=megatron_tokens_per_s(489.1, 32, 6144, 4096, 131072), dtype="float32",
        precision="bf16-mixed", optimizer="fused", published=True, optimizer_shards=48, note=MEGATRON_ZERO1_TP),
    Row("megatron-lm gpt 32b tp8 dp48 384 gpus", MEGATRON_SOURCE + ", row 32B", f"gpt:48:7168:56:{MEGATRON_GPT}", 0.5, 4096,
        (48, 8), "megatron_sp", "h100-80g", 80 * GIB,
        measured_tokens_per_s=megatron_tokens_per_s(459.6, 48, 7168, 4096, 131072), dtype="float32",
        precision="bf16-mixed", optimizer="fused", published=True, optimizer_shards=48, note=MEGATRON_ZERO1_TP),
)  # fmt: skip


def megatron_2021_tokens_per_s(tflops_per_gpu: float, layers: int, hidden: int, seq: int, vocab: int) -> float:
    """Tokens/s per GPU from the achieved TFLOP/s of Narayanan et al. 2021 ("Efficient Large-Scale
    Language Model Training on GPU Clusters Using Megatron-LM", arXiv 2104.04473, eq. 3), which
    count the recompute of full activation checkpointing: 96·l·h²·(1 + s/(6h) + V/(16·l·h)) per token."""
    return tflops_per_gpu * 1e12 / (96 * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden)))


# Megatron-LM's A100 table of 2021 (README.md, images/cases_april2021.png, added in 50a4b5fa02 and
# kept to fd5cfec0ba; the paper's Table 1): GPT of vocabulary 51,200 and sequence 2,048 on
# Selene's DGX A100 80 GB nodes (the a100-80g preset), data-parallel size 32, TP as its
# "model-parallel size" below 16 (the larger rows are pipelined, left out as above). Attention
# heads are the paper's (24, 32, 32, 48; the image has none). The paper trains in fp16 with full
# activation recomputation and counts its FLOPs; the layer as GPT-3's with a tied embedding
# (1.7B at 24 x 2304). No distributed optimizer or sequence parallelism existed yet: "ddp" and
# "megatron". Its microbatch is not published: each data-parallel rank's 16 or 32 sequences are
# priced as one batch, which full recompute keeps small. Ampere has no measured rates: the
# H200's fractions of peak are applied (``row_cluster``), an assumption these rows test.
MEGATRON_2021_SOURCE = "NVIDIA/Megatron-LM README.md, images/cases_april2021.png at fd5cfec0ba (arXiv 2104.04473 Table 1)"
MEGATRON_2021_GPT = "vocab=51200:block=2048:bias"
MEGATRON_2021_NOTE = "fp16 priced as bf16-mixed (same peak, fp32 gradient reduction); A100 at Hopper's fractions of peak"
MEGATRON_2021_ROWS = tuple(
    Row(f"megatron-lm 2021 gpt {size} tp{tp} dp32 {32 * tp} a100s", f"{MEGATRON_2021_SOURCE}, row {size}",
        f"gpt:{layers}:{hidden}:{heads}:{MEGATRON_2021_GPT}", global_batch / (32 * tp), 2048, (32, tp) if tp > 1 else (32,),
        "megatron" if tp > 1 else "ddp", "a100-80g", 80 * GIB,
        measured_tokens_per_s=megatron_2021_tokens_per_s(tflops, layers, hidden, 2048, 51200), dtype="float32",
        precision="bf16-mixed", checkpointing="full", optimizer="fused", published=True, note=MEGATRON_2021_NOTE)
    for size, hidden, layers, heads, tp, global_batch, tflops in (
        ("1.7b", 2304, 24, 24, 1, 512, 137), ("3.6b", 3072, 30, 32, 2, 512, 138),
        ("7.5b", 4096, 36, 32, 4, 512, 142), ("18.4b", 6144, 40, 48, 8, 1024, 135),
    )
)  # fmt: skip


# mosaicml/llm-foundry scripts/train/benchmarking/README.md (at 061f2c7c), "H100 80GB BF16": MPT
# trained by Composer with FSDP FULL_SHARD, mixed precision DEFAULT (in most Composer versions
# bf16 parameters gathered and fp32 reductions, as "bf16-mixed" prices; some earlier ones
# gathered fp32 and reduced bf16: the table names no version), amp_bf16. Only its rows without activation
# checkpointing or gradient accumulation (one microbatch a step, so the step is the microbatch's
# forward, backward and optimizer step). The table's NumParams (6,658,859,008 for 7b at 2048)
# are the zoo GPT's with biases, learned positions of the sequence length, a fused qkv and the
# tied embedding of vocabulary 50,368 (ALiBi off in that sweep). Composer's DecoupledAdamW is a
# loop over parameters of the same elementwise ops as torch's foreach: priced as "foreach".
# Memory is not published.
MPT_SOURCE = "mosaicml/llm-foundry scripts/train/benchmarking/README.md at 061f2c7c, H100 80GB BF16"
MPT_GPT = "vocab=50368:block=2048:bias:fused"
MPT_NOTE = "FSDP FULL_SHARD, no AC, one microbatch a step"
MPT_ROWS = (
    Row("mpt-1b fsdp 8 gpus", MPT_SOURCE + ", 1b 2048 x 8", f"gpt:24:2048:16:{MPT_GPT}", 14, 2048, (8,), "fsdp",
        "h100-80g", 80 * GIB, measured_tokens_per_s=45455, dtype="float32", precision="bf16-mixed", published=True,
        note=MPT_NOTE),
    Row("mpt-7b fsdp 8 gpus", MPT_SOURCE + ", 7b 2048 x 8", f"gpt:32:4096:32:{MPT_GPT}", 6, 2048, (8,), "fsdp",
        "h100-80g", 80 * GIB, measured_tokens_per_s=10643, dtype="float32", precision="bf16-mixed", published=True,
        note=MPT_NOTE),
    Row("mpt-13b fsdp 8 gpus", MPT_SOURCE + ", 13b 2048 x 8", f"gpt:40:5120:40:{MPT_GPT}", 2, 2048, (8,), "fsdp",
        "h100-80g", 80 * GIB, measured_tokens_per_s=4792, dtype="float32", precision="bf16-mixed", published=True,
        note=MPT_NOTE),
    Row("mpt-13b fsdp 64 gpus", MPT_SOURCE + ", 13b 2048 x 64", f"gpt:40:5120:40:{MPT_GPT}", 2, 2048, (64,), "fsdp",
        "h100-80g", 80 * GIB, measured_tokens_per_s=4800, dtype="float32", precision="bf16-mixed", published=True,
        note=MPT_NOTE),
)  # fmt: skip


ROWS = (
    Row("hf-llama-3-8b 4L 2x4096 eager", "issue 43/44, one H200, torch 2.11", "hf-llama-3-8b:4", 2, 4096, (1,), "plan",
        "h200-141g", 141 * GIB, measured_step_s=0.1645, measured_peak_gib=30.9),
    Row("hf-llama-3-8b 4L 2x4096 autopar", "results/h200/gpu_step_hf-llama.csv, one H200, torch 2.11", "hf-llama-3-8b:4", 2,
        4096, (1,), "plan", "h200-141g", 141 * GIB, measured_step_s=0.16695, measured_peak_gib=29.245),
    Row("gpt 12x768 8x1024 eager", "issue 43/44, one H200", "gpt:12:768:12", 8, 1024, (1,), "plan",
        "h200-141g", 141 * GIB, measured_step_s=0.0218, measured_peak_gib=5.3),
    Row("gpt 12x768 8x1024 autopar", "results/h200/gpu_step_gpt.csv, one H200, torch 2.11", "gpt:12:768:12", 8, 1024, (1,),
        "plan", "h200-141g", 141 * GIB, measured_step_s=0.02046, measured_peak_gib=5.532),
    Row("zoo llama-3-8b 2L 2x2048 eager", "results/gpu_compiled_default.csv, one H200", "zoo-llama-3-8b:2", 2, 2048, (1,),
        "plan", "h200-141g", 141 * GIB, measured_step_s=0.062481, measured_peak_gib=13.85),
    Row("zoo llama-3-8b 2L 2x2048 eager fused", "results/gpu_compiled_fused.csv, one H200", "zoo-llama-3-8b:2", 2, 2048,
        (1,), "plan", "h200-141g", 141 * GIB, measured_step_s=0.051959, measured_peak_gib=12.84, optimizer="fused"),
    Row("gpt 12x768 8x1024 fwd+bwd", "results/gpu_step.csv, one H100", "gpt:12:768:12", 8, 1024, (1,), "plan",
        "h100-80g", 80 * GIB, measured_step_s=0.019369, measured_peak_gib=5.5867, with_optimizer=False),
    Row("gpt 24x1024 8x1024 fwd+bwd", "results/gpu_step.csv, one H100", "gpt:24:1024:16", 8, 1024, (1,), "plan",
        "h100-80g", 80 * GIB, measured_step_s=0.045528, measured_peak_gib=11.0535, with_optimizer=False),
    Row("gpt 8x2048 8x1024 fwd+bwd", "results/gpu_step.csv, one H100", "gpt:8:2048:16", 8, 1024, (1,), "plan",
        "h100-80g", 80 * GIB, measured_step_s=0.047812, measured_peak_gib=10.2183, with_optimizer=False),
    Row("zoo llama-3-8b 4L 4x2048 fwd+bwd", "results/gpu_step.csv, one H100", "zoo-llama-3-8b:4", 4, 2048, (1,), "plan",
        "h100-80g", 80 * GIB, measured_step_s=0.13227, measured_peak_gib=26.4545, with_optimizer=False),
    Row("zoo llama-2-7b 8L 4x2048 fwd+bwd", "results/gpu_step.csv, one H100", "zoo-llama-2-7b:8", 4, 2048, (1,), "plan",
        "h100-80g", 80 * GIB, measured_step_s=0.181503, measured_peak_gib=26.1153, with_optimizer=False),
    # torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and 3 (bf16, no compile,
    # no Float8): Llama 3.1 8B, FSDP, selective AC, local batch 2 x 8192, H100 96 GB, 500 W. At
    # its commit (9dec370) AdamW is foreach (optimizer.fused is off unless asked; llama3_8b.toml
    # does not), params bf16 and reductions fp32 (mixed_precision_*), gradients clipped at 1.0.
    # Its AC is op-level (llama3_8b.toml: mode "selective", selective_ac_option "op"): attention
    # and every other mm kept, "selective-op" here; its loss takes fp32 logits ("titan-" models).
    # Its memory column is the caching allocator's max reserved (torchtitan's metrics log
    # ``reserved_bytes.all.peak``), with expandable segments (run_llama_train.sh sets
    # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True): priced by the allocator model.
    Row("torchtitan llama-3.1-8b fsdp 8 gpus", "torchtitan llama3_h100_202412, Table 1", "titan-llama-3-8b:32", 2, 8192, (8,),
        "fsdp", "grand-teton", 96e9, measured_tokens_per_s=5762, measured_peak_gib=82.4, dtype="float32",
        precision="bf16-mixed", checkpointing="selective-op", optimizer="foreach", published=True,
        measured_memory="reserved", allocator="expandable", kept="root+last"),
    Row("torchtitan llama-3.1-8b fsdp 128 gpus", "torchtitan llama3_h100_202412, Table 3", "titan-llama-3-8b:32", 2, 8192,
        (128,), "fsdp", "grand-teton", 96e9, measured_tokens_per_s=5605, measured_peak_gib=67.0, dtype="float32",
        precision="bf16-mixed", checkpointing="selective-op", optimizer="foreach", published=True,
        measured_memory="reserved", allocator="expandable", kept="root+last"),
    *MEGATRON_ROWS,
    *MEGATRON_2021_ROWS,
    *MPT_ROWS,
)  # fmt: skip


class TitanLlama(Llama):
    """The zoo's Llama with torchtitan's loss: cross-entropy of the logits cast to fp32
    (torchtitan's ``cross_entropy_loss``: ``pred.flatten(0, 1).float()``), whose log-probabilities
    and gradients are fp32 where the zoo's, under bf16, are bf16."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits = super().forward(idx)
        if targets is None:
            return logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def build_model(spec: str, dtype: torch.dtype, device: str | torch.device = "meta") -> torch.nn.Module:
    """The row's model, on the meta device unless told."""
    kind, *args = spec.split(":")
    with torch.device(device):
        if kind == "gpt":
            model = GPT(**_gpt_config(args))
        elif kind.startswith("zoo-"):
            model = Llama(**{**LLAMA_SHAPES[kind.removeprefix("zoo-")], "n_layer": int(args[0])})
        elif kind.startswith("titan-"):
            model = TitanLlama(**{**LLAMA_SHAPES[kind.removeprefix("titan-")], "n_layer": int(args[0])})
        elif kind == "hf-llama-3-8b":
            import transformers  # optional dependency: only these rows need it

            config = transformers.LlamaConfig(
                use_cache=False, attn_implementation="sdpa", **{**HF_LLAMA_3_8B, "num_hidden_layers": int(args[0])}
            )
            model = transformers.LlamaForCausalLM(config)
        else:
            raise ValueError(f"unknown model {spec!r}")
    return model.to(dtype)


def _gpt_config(args: list[str]) -> dict:
    """The zoo GPT's arguments from ``L:E:H`` (layers, width, heads) and options: ``vocab=V``
    (default 50304), ``block=S`` (learned positions, default 1024), ``bias`` (Linear and
    LayerNorm biases, as GPT-3, Megatron's GPT and MPT of 2023 have; default none),
    ``untied`` (an LM head of its own), ``fused`` (one qkv Linear)."""
    layers, width, heads = map(int, args[:3])
    config = dict(vocab_size=50304, block_size=1024, n_layer=layers, n_head=heads, n_embd=width, bias=False)
    for option in args[3:]:
        key, _, value = option.partition("=")
        if key in ("vocab", "block"):
            config[{"vocab": "vocab_size", "block": "block_size"}[key]] = int(value)
        elif key in ("bias", "untied", "fused") and not value:
            config[{"bias": "bias", "untied": "tied", "fused": "fused_qkv"}[key]] = key != "untied"
        else:
            raise ValueError(f"unknown GPT option {option!r}: expected vocab=V, block=S, bias, untied or fused")
    return config


def _inputs(row: Row, model: torch.nn.Module) -> dict:
    """The global batch: ``row.batch`` rows per GPU on every GPU of the mesh."""
    ids = torch.zeros(row.global_batch, row.seq, dtype=torch.long, device="meta")
    if row.model.startswith("hf-"):
        return {"example_kwargs": {"input_ids": ids, "labels": ids.clone()}}
    return {"example_inputs": (ids, ids.clone())}


def grand_teton() -> ClusterSpec:
    """torchtitan's machine: the ``h100-96g`` preset (Grand Teton hosts of 8 H100s with 96 GB of
    HBM2e at 2.4 TB/s, NVLink inside a host, 400 Gb/s RDMA per GPU, a 500 W power limit whose
    peak torchtitan bounds between the H100 NVL's and SXM's; the preset's notes say which figures
    come from where)."""
    return get_cluster("h100-96g")


def row_cluster(row: Row, profiled: ClusterSpec | None) -> ClusterSpec:
    """The row's spec: a profiled one for the H200 rows when given; H100 rows take the H200's
    achieved rates (same Hopper tensor cores and kernels) on the H100 preset's peaks."""
    if profiled is not None and row.preset == "h200-141g":
        return profiled
    spec = grand_teton() if row.preset == "grand-teton" else get_cluster(row.preset)
    if spec.rates is None:
        spec = dataclasses.replace(spec, rates=get_cluster("h200-141g").rates)
    return dataclasses.replace(spec, memory_bytes=int(row.memory_bytes))


def _local_elements(plan, model: torch.nn.Module, mesh: tuple[int, ...], dp_shards: int = 1) -> float:
    """Parameter elements each rank's optimizer steps: a sharded parameter's share, and of one
    replicated on the data-parallel axis (axis 0) 1/``dp_shards`` of that (a distributed optimizer's
    split; a parameter the plan splits over that axis already, FSDP's, is not split again)."""
    replicated = split = 0.0  # (replicated on axis 0, split there)
    for name, param in model.named_parameters():
        shards = 1
        spec = plan.params.get(name) or ()  # one placement per mesh axis
        for axis, placement in enumerate(spec):
            if placement.is_shard():
                shards *= mesh[axis]
        if spec and spec[0].is_shard():
            split += param.numel() / shards
        else:
            replicated += param.numel() / shards
    return replicated / dp_shards + split


def _kept_layers(row: Row, model: torch.nn.Module) -> tuple[str, ...] | None:
    """``CommOptions.reshard_after_forward`` of the job's own schedule (``Row.kept``)."""
    if row.kept == "root":
        return None
    layers = {param_layer(name) for name, _ in model.named_parameters()} - {""}
    return ("", max(layers, key=lambda layer: int(layer.rsplit(".", 1)[1])))


def price(row: Row, model: torch.nn.Module, cluster: ClusterSpec, layout: str, search: bool = False) -> dict:
    """Plan the row's job as ``layout`` and price its step and peak memory (``search``: the
    solver's plan on the mesh it picks for the job's GPUs, ``mesh="auto"``)."""
    # None: "32-true", the model's own dtypes; torch's AdamW state takes the parameters' dtype, as priced
    kwargs = dict(_inputs(row, model), cluster=cluster, precision=row.precision)
    if row.with_optimizer:  # the AdamW the run stepped with: its time, and what it holds while it steps
        kwargs["optimizer"] = f"adamw:{row.optimizer}"
    if row.published:  # as torchtitan ran: the whole device, no reserve
        kwargs["memory_budget"] = row.memory_bytes
    split = 0.0
    if layout == "plan":
        mesh = "auto" if search else row.mesh
        plan = autopar.plan(model, mesh, devices=math.prod(row.mesh) if search else None, **kwargs)
    else:
        if row.checkpointing and "checkpointing" in inspect.signature(autopar.hand_plan).parameters:
            kwargs["checkpointing"] = row.checkpointing
        kwargs["comm"] = autopar.CommOptions(reshard_after_forward=_kept_layers(row, model))  # as the job ran
        split = _distributed_optimizer_bytes(row, model, layout)
        if split:  # the budget of the walk whose AdamW state is unsplit
            kwargs["memory_budget"] = row.memory_bytes + split
            kwargs["cluster"] = dataclasses.replace(cluster, memory_bytes=int(row.memory_bytes + split))
        plan = autopar.hand_plan(layout, model, row.mesh, **kwargs)
    # The plan's step holds its memory decisions (memory_s) and the AdamW step of the kind the run
    # stepped with (optimizer_s, cost.optimizer): taken out where the run had none, and for a
    # published layout's distributed optimizer swapped for the step of its share.
    step = plan.predicted.step_time_s
    if not row.with_optimizer:
        step -= plan.predicted.optimizer_s or 0.0
    elif row.optimizer_shards > 1 and layout != "plan":
        param_size = 4 if row.precision else torch.finfo(getattr(torch, row.dtype)).bits // 8
        step += -(plan.predicted.optimizer_s or 0.0) + optimizer_step_s(
            # the published layout's distributed optimizer; autopar.plan's own splits no state
            _local_elements(plan, model, row.mesh, row.optimizer_shards),
            param_size,
            param_size,
            len(list(model.parameters())),
            cluster.memory_bandwidth_bytes_per_s,
            cluster.rates,
            row.optimizer,
        )
    peak = plan.predicted.peak_memory_bytes
    if not row.with_optimizer:  # the run measured forward and backward alone
        peak = _peak_without_temporary(plan)
    return {"step_s": step, "peak_gib": (peak - split) / GIB, "plan": plan, "split_gib": split / GIB}


def _distributed_optimizer_bytes(row: Row, model: torch.nn.Module, layout: str) -> float:
    """AdamW state bytes that a distributed optimizer over ``row.optimizer_shards`` ranks frees on
    each, for a tensor-parallel hand plan, which prices that state unsplit (ZeRO-1 hand plans
    split it themselves, and only over a DDP layout). The state lives the whole step, so the walk
    with it unsplit under the budget plus these bytes is the split walk under the budget: exact
    for the hand plan's fixed parameter specs. Each rank's parameters are Megatron's
    (``megatron_placement``, tensor-parallel on the inner axis); state in fp32 under a mixed
    precision, else in the model's dtype."""
    if row.optimizer_shards == 1 or layout not in ("megatron", "megatron_sp"):
        return 0.0
    tp = row.mesh[-1]
    local = sum(
        p.numel() / (tp if megatron_placement(name, tuple(p.shape)).is_shard() else 1) for name, p in model.named_parameters()
    )
    state_itemsize = 4 if row.precision else torch.finfo(getattr(torch, row.dtype)).bits // 8
    return 2 * state_itemsize * local * (1 - 1 / row.optimizer_shards)


def _peak_without_temporary(plan) -> float:
    """The plan's peak without what torch's foreach AdamW holds while it steps (the walk's
    "optimizer_temporary", at its last time), for a run measured without its optimizer step: the
    fullest time of the plan's sampled timeline (``Plan.memory_timeline``: each bucket's fullest
    time, the step among them; the walk under the plan's memory decisions) without it."""
    if not plan.predicted.memory_at_peak_bytes.get("optimizer_temporary"):
        return plan.predicted.peak_memory_bytes
    timeline = plan.memory_timeline
    kinds = timeline["kinds"]
    return max(sum(b for kind, b in zip(kinds, row) if kind != "optimizer_temporary") for row in timeline["bytes"])


def reserved_gib(plan, row: Row) -> float | None:
    """The plan's reserved peak (``predicted.allocator_peak_bytes``) under the row's allocator,
    as FSDP2 allocates for a published FSDP job (torchtitan's ``fully_shard``)."""
    peaks = plan.predicted.allocator_peak_bytes
    if not peaks:
        return None
    key = "reserved" + ("_fsdp2" if row.published and row.layout == "fsdp" else "")
    key += "_expandable" if row.allocator == "expandable" else ""
    # FSDP2's pools are modelled with expandable segments only: None where a row ran otherwise
    return peaks[key] / GIB if key in peaks else None


def describe(plan) -> str:
    """A plan's layout in a few words: parameter specs by count, checkpointing, offload."""
    from collections import Counter

    specs = Counter(" ".join(format_spec(spec)) for fqn, spec in plan.params.items() if fqn.endswith("weight"))
    words = [", ".join(f"{count} weights {spec}" for spec, count in specs.most_common(3))]
    memory = plan.memory
    if memory is not None and memory.checkpoint:
        policies = Counter(getattr(segment, "policy", "full") for segment in memory.checkpoint)
        words.append("AC " + ", ".join(f"{n} {p}" for p, n in policies.items()))
    if memory is not None and memory.offload:
        words.append(f"offload {len(memory.offload)} to {memory.target}")
    return "; ".join(words)


def evaluate(row: Row, profiled: ClusterSpec | None, search: bool = True) -> dict:
    """The row priced as it ran, and for a published job what ``autopar.plan`` picks: on its mesh,
    and (``search``) on the mesh it picks for the job's GPUs."""
    cluster = row_cluster(row, profiled)
    model = build_model(row.model, getattr(torch, row.dtype))
    out = {"row": row.name, "source": row.source, "cluster": cluster.name, "layout": row.layout, "status": "priced"}
    out["note"] = row.note
    tokens = row.batch * row.seq
    start = time.perf_counter()
    try:
        got = price(row, model, cluster, row.layout)
    except Exception as err:  # a layout autopar cannot express yet: the row says why
        message = str(err).splitlines()[0]
        # the start says what failed, the end why
        message = message if len(message) <= 240 else f"{message[:100]} ... {message[-130:]}"
        out["status"] = f"{type(err).__name__}: {message}"
        got = None
    if got is not None:
        out["layout_detail"] = describe(got["plan"])
        out["predicted_step_s"] = got["step_s"]
        out["predicted_allocated_gib"] = got["peak_gib"]
        reserved = reserved_gib(got["plan"], row)
        out["predicted_reserved_gib"] = reserved - got["split_gib"] if reserved is not None else None
        # the figure the run measured: tensors allocated, or the allocator's reserve
        out["predicted_peak_gib"] = out[f"predicted_{row.measured_memory}_gib"]
        out["predicted_optimizer_s"] = got["plan"].predicted.optimizer_s
        # where the step goes: compute, resharding (TP and FSDP collectives), exposed gradient sync
        for part in ("compute_s", "reshard_s", "exposed_grad_sync_s"):
            out[f"predicted_{part}"] = getattr(got["plan"].predicted, part)
    measured_step = row.measured_step_s or (tokens / row.measured_tokens_per_s if row.measured_tokens_per_s else None)
    out["measured_step_s"] = measured_step
    out["measured_peak_gib"] = row.measured_peak_gib
    out["measured_memory"] = f"{row.measured_memory} ({row.allocator})" if row.measured_memory == "reserved" else "allocated"
    if got is not None and measured_step:
        out["time_ratio"] = got["step_s"] / measured_step
        out["predicted_tokens_per_s"] = tokens / got["step_s"]
        out["measured_tokens_per_s"] = tokens / measured_step
    if got is not None and row.measured_peak_gib and out["predicted_peak_gib"]:
        out["memory_ratio"] = out["predicted_peak_gib"] / row.measured_peak_gib
    if row.published:  # what autopar.plan picks for the same job and budget
        solved = price(row, model, cluster, "plan")
        out["solver_step_s"] = solved["step_s"]
        out["solver_peak_gib"] = solved["peak_gib"]
        out["solver_layout"] = describe(solved["plan"])
        if got is not None:
            out["solver_over_published"] = solved["step_s"] / got["step_s"]
        if search:  # the job's GPUs on the mesh the solver picks (``mesh="auto"``)
            searched = price(row, model, cluster, "plan", search=True)
            out["searched_mesh"] = "x".join(map(str, searched["plan"].mesh_shape))
            out["searched_step_s"] = searched["step_s"]
            out["searched_peak_gib"] = searched["peak_gib"]
            out["searched_layout"] = describe(searched["plan"])
            if got is not None:
                out["searched_over_published"] = searched["step_s"] / got["step_s"]
    out["plan_s"] = time.perf_counter() - start
    return out


def evaluate_405b(microbatches: int) -> dict:
    """torchtitan's Table 5 job (Llama 3.1 405B, 512 H100s, FSDP 8 x TP 8 x PP 8, interleaved
    1F1B, full AC, 256 x 8192 tokens): its layout and autopar's stage search, priced with the
    rates by ``bench_llama405b_pipeline``'s machinery. Measured 128 tokens/s/GPU with Float8 and
    torch.compile, which autopar does not price (bf16 eager): the measured step is a floor."""
    import bench_llama405b_pipeline as job  # a sibling benchmark: its job definition and pricing

    spec = grand_teton()
    start = time.perf_counter()
    theirs = job.torchtitan(spec)[-1]
    search, _ = job.ours(spec, microbatches)
    tokens = job.GLOBAL_BATCH * job.SEQ
    measured = tokens / (128 * 512)
    return {
        "row": "torchtitan llama-3.1-405b fsdp8 tp8 pp8 512 gpus",
        "source": "torchtitan llama3_h100_202412, Table 5 (Float8 + compile)",
        "cluster": spec.name,
        "layout": f"{theirs['schedule']} x{theirs['virtual_stages']}, {theirs['stages']} stages of {theirs['stage_mesh']}",
        "status": "priced (bf16 eager; measured with Float8 and compile)",
        "predicted_step_s": theirs["step_s"],
        "measured_step_s": measured,
        "time_ratio": theirs["step_s"] / measured,
        "predicted_tokens_per_s": theirs["tokens_per_s_per_gpu"],
        "measured_tokens_per_s": 128.0,
        "predicted_peak_gib": theirs["peak_gib"],
        "solver_step_s": search.step_time_s,
        "solver_peak_gib": max(st.memory_bytes for st in search.stages) / GIB,
        "solver_over_published": search.step_time_s / theirs["step_s"],
        "solver_layout": f"{search.schedule} on {search.num_stages} stages of {'x'.join(map(str, search.stage_mesh))}, "
        f"{search.num_microbatches} microbatches",
        "plan_s": time.perf_counter() - start,
    }


COLUMNS = (
    "row", "source", "cluster", "layout", "status", "predicted_step_s", "measured_step_s", "time_ratio",
    "predicted_tokens_per_s", "measured_tokens_per_s", "predicted_peak_gib", "measured_peak_gib", "memory_ratio",
    "layout_detail", "solver_step_s", "solver_peak_gib", "solver_over_published", "solver_layout", "plan_s",
    "predicted_optimizer_s", "measured_memory", "predicted_allocated_gib", "predicted_reserved_gib", "note",
    "predicted_compute_s", "predicted_reshard_s", "predicted_exposed_grad_sync_s",
    "searched_mesh", "searched_step_s", "searched_peak_gib", "searched_over_published", "searched_layout",
)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="*", help="substrings of row names to run (default: all)")
    parser.add_argument("--cluster", help="a spec from `autopar profile` for the H200 rows")
    parser.add_argument("--out", default="benchmarks/results/calibration.csv")
    parser.add_argument("--layout", help="price each row's job as this hand plan instead of its published layout (fsdp, say)")
    parser.add_argument(
        "--no-mesh-search", dest="search", action="store_false", help="skip the solver's plan on a mesh of its choosing"
    )
    parser.add_argument(
        "--405b-microbatches",
        dest="microbatches_405b",
        type=int,
        default=128,
        help="autopar's stage search for the 405B job at this microbatch count (0: skip the row)",
    )
    args = parser.parse_args(argv)
    profiled = ClusterSpec.load(args.cluster) if args.cluster else None
    rows = [r for r in ROWS if not args.rows or any(s in r.name for s in args.rows)]
    rows = [dataclasses.replace(r, layout=args.layout) for r in rows] if args.layout else rows
    results = []
    for row in rows:
        result = evaluate(row, profiled, args.search)
        results.append(result)
        shown = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in result.items() if k != "source"}
        print(shown, flush=True)
    if args.microbatches_405b and (not args.rows or any(s in "405b" for s in args.rows)):
        results.append(evaluate_405b(args.microbatches_405b))
        print({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in results[-1].items()}, flush=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows({k: result.get(k) for k in COLUMNS} for result in results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
