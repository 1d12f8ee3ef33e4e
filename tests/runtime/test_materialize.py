"""Meta-device models: tracing with FakeTensors, and seeded per-rank shards (no process group)."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.ir.spec import R, S
from autopar.runtime.materialize import FromCheckpoint, SeededInit, checkpoint_shards, seeded_shards
from autopar.trace import trace
from autopar.trace.fake import fake_tensors, has_meta_tensors
from autopar.zoo.models import GPT, build_model, example_batch


def _meta(name: str, **config) -> torch.nn.Module:
    with torch.device("meta"):
        return build_model(name, **config)


def test_meta_model_traces_like_the_cpu_model() -> None:
    model = _meta("gpt")
    batch = example_batch("gpt", batch_size=4)
    with fake_tensors(model):
        traced = trace(model, batch)
    assert traced.graph_hash == trace(build_model("gpt"), batch).graph_hash
    assert trace(model, batch).graph_hash == traced.graph_hash, "trace must fake a meta model called with real inputs"
    plan = autopar.plan(model, (2,), example_inputs=batch, cluster="cpu")  # planning offline, as on CPU
    assert plan.graph_hash == traced.graph_hash
    assert traced.ties["lm_head.weight"] == "transformer.wte.weight"
    assert has_meta_tensors(model) and all(p.is_meta for p in model.parameters()), "the model must be left on meta"
    assert model.lm_head.weight is model.transformer.wte.weight


def _whole(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items()}


@pytest.mark.parametrize("mesh_shape", [(1,), (2,), (2, 2)])
def test_seeded_shards_are_shards_of_the_seeded_reference(mesh_shape) -> None:
    init = SeededInit(seed=3, fn=GPT._init_weights)
    reference = init.apply(build_model("gpt", seed=11))  # the constructor's own numbers are overwritten
    meta = _meta("gpt")
    names = list(reference.state_dict())
    # Shard every tensor on dim 0 along the last axis, and the tied table on dim 1 along the first.
    specs = {fqn: (R,) * (len(mesh_shape) - 1) + (S(0),) for fqn in names}
    if len(mesh_shape) == 2:
        specs["transformer.wte.weight"] = specs["lm_head.weight"] = (S(1), S(0))
    coordinates = [
        tuple(int(i) for i in torch.unravel_index(torch.tensor(r), mesh_shape)) for r in range(torch.Size(mesh_shape).numel())
    ]
    for coordinate in coordinates:
        shards = seeded_shards(meta, init, specs, coordinate, mesh_shape)
        assert shards["lm_head.weight"] is shards["transformer.wte.weight"], "a tied tensor must stay one shard"
        for fqn in names:
            want = reference.state_dict()[fqn]
            for axis, placement in enumerate(specs[fqn]):
                if placement != R:
                    want = want.chunk(mesh_shape[axis], placement.dim)[coordinate[axis]]
            assert torch.equal(shards[fqn], want), f"{fqn} at {coordinate}"
    assert all(p.is_meta for p in meta.parameters()), "the meta model must be left as it was"


def test_seeded_init_is_not_the_global_rng() -> None:
    model = build_model("mlp")
    torch.manual_seed(0)
    before = torch.rand(3)
    torch.manual_seed(0)
    SeededInit(seed=5).apply(model)
    assert torch.equal(torch.rand(3), before), "SeededInit must not move the caller's random stream"


def test_uninitialized_parameter_is_named() -> None:
    # LLaMA's RMSNorm has a weight and no reset_parameters: without fn it would stay NaN.
    model = _meta("llama")
    specs = {fqn: (R,) for fqn in model.state_dict()}
    with pytest.raises(ValueError, match=r"model\.layers\.0\.input_layernorm\.weight.*SeededInit\(seed, fn=") as info:
        seeded_shards(model, SeededInit(seed=0), specs, (0,), (1,))
    assert "RMSNorm" in str(info.value)

    def init_norms(module: torch.nn.Module) -> None:
        if type(module).__name__ == "RMSNorm":
            torch.nn.init.ones_(module.weight)

    shards = seeded_shards(model, SeededInit(seed=0, fn=init_norms), specs, (0,), (1,))
    assert torch.equal(shards["model.norm.weight"], torch.ones(64))


def test_seeded_init_checks_its_arguments() -> None:
    with pytest.raises(TypeError, match="seed must be an int"):
        SeededInit(seed=1.5)
    with pytest.raises(TypeError, match="function of one module"):
        SeededInit(seed=0, fn=3)
    assert autopar.SeededInit is SeededInit


def test_one_module_is_whole_at_a_time() -> None:
    """While a module is initialized, its own tensors are the only real ones in the model."""
    model = _meta("gpt")
    seen: list[tuple[str, list[int]]] = []

    def record(module: torch.nn.Module) -> None:
        GPT._init_weights(module)
        real = [p.numel() for _, p in model.named_parameters(remove_duplicate=False) if not p.is_meta]
        own = [p.numel() for p in module.parameters(recurse=False)]
        seen.append((type(module).__name__, real, own))

    specs = {fqn: (R,) for fqn in model.state_dict()}
    seeded_shards(model, SeededInit(seed=0, fn=record), specs, (0,), (1,))
    assert len(seen) == len(list(model.modules()))
    for name, real, own in seen:
        # (A tied tensor also stays whole, unattached, until its last owner is done.)
        assert sorted(real) == sorted(own), f"while initializing a {name}, whole tensors {real}, its own {own}"


def test_from_checkpoint_makes_the_buffers_no_checkpoint_holds() -> None:
    """A Hugging Face LLaMA's RoPE frequencies are a non-persistent buffer: not in any checkpoint."""
    transformers = pytest.importorskip("transformers")
    from tests.zoo.hf_models import llama

    cpu, _ = llama(batch_size=2)
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(cpu.config)
    specs = {"model.rotary_emb.inv_freq": (R,), "lm_head.weight": (S(0),)}
    with pytest.raises(ValueError, match=r"non-persistent: model.rotary_emb.inv_freq\).*unsaved="):
        checkpoint_shards(meta, FromCheckpoint("ckpt"), specs, (1,), (2,))
    init = SeededInit(seed=0, fn=meta._init_weights)
    shards = checkpoint_shards(meta, FromCheckpoint("ckpt", unsaved=init), specs, (1,), (2,))
    assert torch.equal(shards["model.rotary_emb.inv_freq"], cpu.model.rotary_emb.inv_freq)
    assert shards["lm_head.weight"].shape == (64, 32), "the checkpoint's tensors: allocated for load to fill"
