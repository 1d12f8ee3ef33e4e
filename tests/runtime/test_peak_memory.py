"""The compiled module holds no more memory than eager: at its peak over a training step, and
between steps (no second copy of the weights).

The peak is the host allocator's, read from the profiler's memory events (what CUDA's
``max_memory_allocated`` is on a GPU): every allocation and free in order, and the highest sum.
The model is a LLaMA whose vocabulary dwarfs its width, as a real LLaMA's logits dwarf one layer's
activations: a logits-sized tensor kept alive a little longer than eager keeps it (the float32
copy the loss makes, a graph output, a saved tensor) would lift the peak by a quarter."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import autopar

transformers = pytest.importorskip("transformers")

VOCAB, ROWS, SEQ = 8192, 2, 128


def _llama(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=224,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        attn_implementation="sdpa",
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config).to(dtype).train()


def _ids() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(4, VOCAB, (ROWS, SEQ), generator=generator), torch.randint(4, VOCAB, (ROWS, SEQ), generator=generator)


def peak_bytes(fn) -> int:
    """The highest sum of host bytes allocated and not yet freed while ``fn()`` runs."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns())
    held = peak = 0
    for event in events:
        held += event.nbytes()
        peak = max(peak, held)
    return peak


def _step_peak(module: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> int:
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        module(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()

    step()  # the optimizer's state exists from here on, in both
    return peak_bytes(step)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_training_steps_peak_is_within_5_percent_of_eagers(world_of_one, dtype):
    ids, labels = _ids()
    model = _llama(dtype)
    eager = copy.deepcopy(model)
    pm = autopar.compile(model, (1,), example_kwargs=dict(input_ids=ids, labels=labels))
    eager_peak, ours = _step_peak(eager, ids, labels), _step_peak(pm, ids, labels)
    logits_fp32 = ROWS * SEQ * VOCAB * 4
    assert eager_peak > 2 * logits_fp32  # the measurement sees the step's activations
    assert ours <= 1.05 * eager_peak, f"compiled step peak {ours} B against eager's {eager_peak} B"


def _live_host_bytes() -> int:
    """Bytes of the distinct host storages of the tensors the garbage collector tracks."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def test_compile_keeps_no_second_copy_of_the_weights(world_of_one):
    ids, labels = _ids()
    model = _llama(torch.float32)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    before = _live_host_bytes() - weight_bytes
    pm = autopar.compile(model, (1,), example_kwargs=dict(input_ids=ids, labels=labels))
    del model
    held = _live_host_bytes() - before
    assert held <= 1.02 * weight_bytes, f"the compiled module holds {held} B of tensors for {weight_bytes} B of weights"
    assert pm(input_ids=ids, labels=labels).loss.isfinite()
