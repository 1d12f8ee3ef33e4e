"""The zoo: Hugging Face architectures from tiny configs, compiled and compared with eager.

    python scripts/zoo.py                      # every model, 4 gloo ranks, mesh (2, 2), cluster cpu
    python scripts/zoo.py llama whisper        # some of them
    python scripts/zoo.py --guard              # in one process, with the numerics guard (no spawn)
    python scripts/zoo.py --markdown docs/zoo.md

Each model is planned on mesh (2, 2) with ``cluster="cpu"`` twice: with no memory budget, and
with a tight one (90% of its replicated parameters' bytes with gradients and AdamW state, so
that no plan keeping every parameter whole fits; where activations make that infeasible, 2%
above the leanest plan's peak). Each plan is compiled and run forward and
backward, and the loss and every gradient are compared with eager PyTorch. A model that autopar
cannot take is refused up front with a TraceError, which the table shows.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import re
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import autopar  # noqa: E402
from autopar.cost.memory import param_state_bytes  # noqa: E402

MESH = (2, 2)
CLUSTER = "cpu"
VOCAB = 128
SEQ = 16
BATCH = 8
TOL = 1e-4
SPECIAL = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}


def _ids(seed: int, shape=(BATCH, SEQ)) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(4, VOCAB, shape, generator=generator), torch.randint(4, VOCAB, shape, generator=generator)


def _built(cls: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    torch.manual_seed(0)
    return cls().float().train()


def _causal(model_cls: str, config_cls: str, **config: Any) -> Callable[[], tuple[torch.nn.Module, dict]]:
    def build() -> tuple[torch.nn.Module, dict]:
        import transformers

        base = dict(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
            use_cache=False,
            attn_implementation="sdpa",
            **SPECIAL,
        )
        base.update(config)
        cfg = getattr(transformers, config_cls)(**{k: v for k, v in base.items() if v is not None})
        model = _built(lambda: getattr(transformers, model_cls)(cfg))
        ids, labels = _ids(1)
        return model, {"input_ids": ids, "labels": labels}

    return build


def _seq2seq(model_cls: str, config_cls: str, **config: Any) -> Callable[[], tuple[torch.nn.Module, dict]]:
    """Encoder-decoders take labels and shift them into decoder inputs themselves (an in-place
    write into a slice of a new tensor: the case of issue 15)."""

    def build() -> tuple[torch.nn.Module, dict]:
        import transformers

        base = dict(
            vocab_size=VOCAB,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=SEQ,
            use_cache=False,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            decoder_start_token_id=0,
            attn_implementation="sdpa",
            **SPECIAL,
        )
        base.update(config)
        cfg = getattr(transformers, config_cls)(**base)
        model = _built(lambda: getattr(transformers, model_cls)(cfg))
        ids, labels = _ids(1)
        return model, {"input_ids": ids, "labels": labels}

    return build


def whisper() -> tuple[torch.nn.Module, dict]:
    import transformers

    cfg = transformers.WhisperConfig(
        vocab_size=VOCAB,
        num_mel_bins=8,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_source_positions=16,
        max_target_positions=SEQ,
        use_cache=False,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        decoder_start_token_id=0,
        attn_implementation="sdpa",
        **SPECIAL,
    )
    model = _built(lambda: transformers.WhisperForConditionalGeneration(cfg))
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(BATCH, 8, 32, generator=generator)  # (batch, mel bins, 2 * source positions)
    _, labels = _ids(2)
    return model, {"input_features": features, "labels": labels}


def t5() -> tuple[torch.nn.Module, dict]:
    import transformers

    cfg = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        dropout_rate=0.0,
        use_cache=False,
        decoder_start_token_id=0,
        **SPECIAL,
    )
    model = _built(lambda: transformers.T5ForConditionalGeneration(cfg))
    ids, labels = _ids(1)
    return model, {"input_ids": ids, "labels": labels}


def _encoder(model_cls: str, config_cls: str) -> Callable[[], tuple[torch.nn.Module, dict]]:
    def build() -> tuple[torch.nn.Module, dict]:
        import transformers

        cfg = getattr(transformers, config_cls)(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=SEQ + 4,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            attn_implementation="sdpa",
            pad_token_id=SPECIAL["pad_token_id"],
        )
        model = _built(lambda: getattr(transformers, model_cls)(cfg))
        ids, labels = _ids(1)
        mask = torch.rand(labels.shape, generator=torch.Generator().manual_seed(3)) < 0.85
        return model, {"input_ids": ids, "labels": labels.masked_fill(mask, -100)}

    return build


def vit() -> tuple[torch.nn.Module, dict]:
    import transformers

    cfg = transformers.ViTConfig(
        image_size=16,
        patch_size=4,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        num_labels=8,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="sdpa",
    )
    model = _built(lambda: transformers.ViTForImageClassification(cfg))
    generator = torch.Generator().manual_seed(1)
    return model, {
        "pixel_values": torch.randn(BATCH, 3, 16, 16, generator=generator),
        "labels": torch.randint(0, 8, (BATCH,), generator=generator),
    }


def resnet() -> tuple[torch.nn.Module, dict]:
    import transformers

    cfg = transformers.ResNetConfig(
        num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic", num_labels=8
    )
    model = _built(lambda: transformers.ResNetForImageClassification(cfg))
    generator = torch.Generator().manual_seed(1)
    return model, {
        "pixel_values": torch.randn(BATCH, 3, 16, 16, generator=generator),
        "labels": torch.randint(0, 8, (BATCH,), generator=generator),
    }


class _TeacherForcing(torch.nn.Module):
    """Ten lines that shift targets into inputs by an in-place write into a slice."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 32)
        self.rnn = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, targets: torch.Tensor) -> torch.Tensor:
        inputs = targets.new_zeros(targets.shape)
        inputs[:, 1:] = targets[:, :-1]
        logits = self.head(torch.tanh(self.rnn(self.emb(inputs))))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def teacher_forcing() -> tuple[torch.nn.Module, dict]:
    return _built(_TeacherForcing), {"targets": _ids(1)[0]}


class _SequentialLoss(torch.nn.Module):
    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - the name nn.Sequential uses
        return input.square().mean()


def sequential() -> tuple[torch.nn.Module, dict]:
    model = _built(
        lambda: torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32), _SequentialLoss())
    )
    return model, {"input": torch.randn(BATCH * 4, 32, generator=torch.Generator().manual_seed(1))}


MODELS: dict[str, Callable[[], tuple[torch.nn.Module, dict]]] = {
    # decoder-only, dense
    "llama": _causal("LlamaForCausalLM", "LlamaConfig"),
    "mistral": _causal("MistralForCausalLM", "MistralConfig"),
    "qwen3": _causal("Qwen3ForCausalLM", "Qwen3Config", head_dim=8),
    "gemma2": _causal("Gemma2ForCausalLM", "Gemma2Config", head_dim=8, query_pre_attn_scalar=8, attn_implementation="eager"),
    "phi3": _causal("Phi3ForCausalLM", "Phi3Config"),
    "falcon": _causal(
        "FalconForCausalLM",
        "FalconConfig",
        intermediate_size=None,
        num_key_value_heads=None,
        num_attention_heads=4,
        new_decoder_architecture=False,
        multi_query=True,
    ),
    "gptj": _causal(
        "GPTJForCausalLM",
        "GPTJConfig",
        n_embd=32,
        n_layer=2,
        n_head=4,
        rotary_dim=4,
        n_positions=SEQ,
        hidden_size=None,
        intermediate_size=None,
        num_hidden_layers=None,
        num_attention_heads=None,
        num_key_value_heads=None,
        max_position_embeddings=None,
        attn_implementation="eager",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    ),
    "starcoder2": _causal("Starcoder2ForCausalLM", "Starcoder2Config", residual_dropout=0.0, embedding_dropout=0.0),
    "olmo2": _causal("Olmo2ForCausalLM", "Olmo2Config"),
    "gpt2": _causal(
        "GPT2LMHeadModel",
        "GPT2Config",
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=SEQ,
        hidden_size=None,
        intermediate_size=None,
        num_hidden_layers=None,
        num_attention_heads=None,
        num_key_value_heads=None,
        max_position_embeddings=None,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    ),
    "gpt_neox": _causal(
        "GPTNeoXForCausalLM", "GPTNeoXConfig", num_key_value_heads=None, hidden_dropout=0.0, attention_dropout=0.0
    ),
    "opt": _causal(
        "OPTForCausalLM",
        "OPTConfig",
        ffn_dim=64,
        intermediate_size=None,
        num_key_value_heads=None,
        word_embed_proj_dim=32,
        dropout=0.0,
        attention_dropout=0.0,
        max_position_embeddings=SEQ + 2,
    ),
    # mixture of experts
    "mixtral": _causal("MixtralForCausalLM", "MixtralConfig", num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": _causal(
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    ),
    "deepseek_v3": _causal(
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
        n_shared_experts=1,
        num_key_value_heads=4,
        attn_implementation="eager",
    ),
    # encoder-decoder
    "bart": _seq2seq("BartForConditionalGeneration", "BartConfig"),
    "mbart": _seq2seq("MBartForConditionalGeneration", "MBartConfig"),
    "pegasus": _seq2seq("PegasusForConditionalGeneration", "PegasusConfig"),
    "t5": t5,
    "whisper": whisper,
    # encoders
    "bert": _encoder("BertForMaskedLM", "BertConfig"),
    "roberta": _encoder("RobertaForMaskedLM", "RobertaConfig"),
    # vision
    "vit": vit,
    "resnet": resnet,
    # plain PyTorch patterns of issue 15
    "teacher_forcing": teacher_forcing,
    "sequential": sequential,
}

# A handful that CI compiles on gloo (tests/test_zoo.py): one per family, the cases.
CI_MODELS = ("qwen3", "pegasus", "deepseek_v3", "teacher_forcing", "sequential")


def tight_budget(model: torch.nn.Module) -> float:
    """90% of the replicated parameters' bytes with gradients and AdamW state: no plan that keeps
    every parameter whole fits."""
    return 0.9 * sum(param_state_bytes(p.shape, p.dtype, (), ()) for p in model.parameters())


def _leanest_bytes(error: autopar.InfeasibleError) -> int:
    found = re.search(r"leanest plan needs (\d+) bytes", str(error))
    if found is None:
        raise error
    return int(found.group(1))


def plan_for(model: torch.nn.Module, kwargs: dict, budget: str) -> tuple[autopar.Plan, float | None]:
    """The plan with no budget, or with a tight one: ``tight_budget``, or where activations
    make that infeasible, 2% above the leanest plan's peak (which the error reports)."""
    if budget == "none":
        return autopar.plan(model, MESH, example_kwargs=kwargs, cluster=CLUSTER), None
    memory = tight_budget(model)
    try:
        return autopar.plan(model, MESH, example_kwargs=kwargs, cluster=CLUSTER, memory_budget=memory), memory
    except autopar.InfeasibleError as error:
        memory = 1.02 * _leanest_bytes(error)
        return autopar.plan(model, MESH, example_kwargs=kwargs, cluster=CLUSTER, memory_budget=memory), memory


def _loss(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.loss


def _fallbacks(plan: autopar.Plan) -> list[str]:
    return sorted({node.op for node in plan.nodes.values() if node.source == "fallback"})


def _plan_label(plan: autopar.Plan) -> str:
    from torch.distributed.tensor import Replicate

    sharded = sum(any(not isinstance(p, Replicate) for p in spec) for spec in plan.params.values())
    return f"{sharded}/{len(plan.params)} params sharded"


def compare(name: str, budget: str, build=None, compiler: str | None = None, torch_compile: bool = False) -> dict:
    """Plan, compile (under the current process group) and compare one model with eager.
    ``compiler`` is ``autopar.compile``'s; ``torch_compile`` runs the module through a user's
    ``torch.compile`` as well."""
    from autopar.runtime.tools.launch import max_rel_diff

    model, kwargs = (build or MODELS[name])()
    eager = copy.deepcopy(model)
    memory = tight_budget(model) if budget == "tight" else None
    try:  # rank 0 plans and broadcasts the plan, or its error
        try:
            pm = autopar.compile(
                copy.deepcopy(model), MESH, example_kwargs=kwargs, cluster=CLUSTER, memory_budget=memory, compiler=compiler
            )
        except autopar.InfeasibleError as error:  # activations outweigh the parameters: see plan_for
            memory = 1.02 * _leanest_bytes(error)
            pm = autopar.compile(model, MESH, example_kwargs=kwargs, cluster=CLUSTER, memory_budget=memory, compiler=compiler)
    except autopar.TraceError as error:
        return {"status": "refused", "reason": str(error).splitlines()[0]}
    loss = _loss((torch.compile(pm) if torch_compile else pm)(**kwargs))
    loss.backward()
    want = _loss(eager(**kwargs))
    want.backward()
    grads = {fqn: p.grad for fqn, p in eager.named_parameters(remove_duplicate=False) if p.grad is not None}
    scale = max((g.abs().max().item() for g in grads.values()), default=1.0)
    # A gradient that is zero in exact arithmetic (an attention key bias) holds rounding noise.
    # Parameters without a gradient in eager (requires_grad=False: sinusoidal position tables)
    # are left out of both sides.
    got = {fqn: g for fqn, g in pm.full_grads().items() if fqn in grads}
    rel = {k: v for k, v in max_rel_diff(got, grads).items() if grads[k].abs().max().item() >= 1e-6 * scale}
    worst = max(rel, key=rel.get) if rel else None
    return {
        "status": "ok",
        "loss": (loss.item(), want.item()),
        "loss_rel": abs(loss.item() - want.item()) / max(abs(want.item()), 1e-30),
        "grad_rel": rel[worst] if worst else 0.0,
        "worst": worst,
        "plan": _plan_label(pm.plan),
        "fallbacks": _fallbacks(pm.plan),
        "plan_hash": pm.plan.hash,
    }


def guard(name: str, budget: str) -> dict:
    """Plan and run every rank in this process with the numerics guard."""
    from autopar.runtime.tools.numerics import check_numerics

    model, kwargs = MODELS[name]()
    try:
        plan, _ = plan_for(model, kwargs, budget)
    except autopar.TraceError as error:
        return {"status": "refused", "reason": str(error).splitlines()[0]}
    result = check_numerics(model, plan, (), kwargs, tolerance=TOL)
    worst = max(result.grad_rel, key=result.grad_rel.get) if result.grad_rel else None
    return {
        "status": "ok" if result.ok else "MISMATCH",
        "loss": result.loss,
        "loss_rel": result.loss_rel,
        "grad_rel": result.max_grad_rel,
        "worst": worst,
        "plan": _plan_label(plan),
        "fallbacks": _fallbacks(plan),
        "first_bad": None if result.first_bad is None else result.first_bad.node,
    }


def _run_ranks(rank: int, world: int, names: list[str]) -> dict:
    out = {}
    for name in names:
        for budget in ("none", "tight"):
            start = time.perf_counter()
            try:
                out[(name, budget)] = compare(name, budget)
            except Exception as error:  # noqa: BLE001 - one model's failure is a row of the table
                out[(name, budget)] = {"status": "error", "reason": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
            out[(name, budget)]["seconds"] = time.perf_counter() - start
    return out


def passed(result: dict) -> bool:
    if result["status"] == "refused":
        return True
    return result["status"] == "ok" and result["loss_rel"] <= TOL and result["grad_rel"] <= TOL


def table(results: dict) -> str:
    lines = [
        "| model | budget | result | plan | fallbacks (replicated ops) | loss rel. diff | largest grad rel. diff |",
        "|---|---|---|---|---|---|---|",
    ]
    for (name, budget), r in results.items():
        if r["status"] in ("refused", "error"):
            reason = r["reason"].splitlines()[0].replace("|", "/")
            lines.append(f"| {name} | {budget} | {r['status']}: {reason} | | | | |")
            continue
        verdict = "equal to eager" if passed(r) else f"**{r['status']} / differs**"
        fallbacks = ", ".join(op.replace("aten.", "") for op in r["fallbacks"]) or "none"
        lines.append(f"| {name} | {budget} | {verdict} | {r['plan']} | {fallbacks} | {r['loss_rel']:.1e} | {r['grad_rel']:.1e} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", help=f"models to run (default: all of {', '.join(MODELS)})")
    parser.add_argument("--guard", action="store_true", help="run in one process with the numerics guard")
    parser.add_argument("--markdown", help="write the results table to this file")
    args = parser.parse_args(argv)
    names = args.models or list(MODELS)
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; known: {', '.join(MODELS)}")
    if args.guard:
        results = {}
        for name in names:
            for budget in ("none", "tight"):
                start = time.perf_counter()
                try:
                    results[(name, budget)] = guard(name, budget)
                except Exception as error:  # noqa: BLE001 - a row of the table
                    results[(name, budget)] = {"status": "error", "reason": f"{type(error).__name__}: {error}"}
                results[(name, budget)]["seconds"] = time.perf_counter() - start
                print(name, budget, results[(name, budget)], flush=True)
    else:
        from autopar.runtime.tools.launch import run_distributed

        results = run_distributed(_run_ranks, math.prod(MESH), names, timeout_s=3600)[0]
    text = table(results)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    return 0 if all(passed(r) for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
