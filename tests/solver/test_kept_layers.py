"""The layers a plan keeps gathered from forward to backward (``CommOptions(reshard_after_forward=
"auto")``, ``solver.planners.kept_layers``): as many of the last ones as the budget holds, where
that is faster than FSDP2's default, recorded in the plan."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.ir.gathers import check_kept_layers
from autopar.ir.options import CommOptions
from autopar.ir.plan import Plan
from autopar.zoo.models import build_model, example_batch

CONFIG = dict(n_layer=4, n_embd=256, vocab_size=1024)
LAYERS = tuple(f"transformer.h.{i}" for i in range(4))


@pytest.fixture(scope="module")
def gpt():
    return build_model("gpt", **CONFIG), example_batch("gpt", batch_size=16, **CONFIG)


def _fsdp(gpt, **keywords) -> Plan:
    model, batch = gpt
    return autopar.hand_plan("fsdp", model, mesh=(8,), example_inputs=batch, cluster="h100-80g", **keywords)


def test_with_memory_to_spare_every_layer_is_kept_and_the_step_is_faster(gpt):
    default = _fsdp(gpt, comm=CommOptions(reshard_after_forward=None))
    kept = _fsdp(gpt)
    assert default.kept_layers is None
    assert kept.kept_layers == ("", *LAYERS)
    # one all-gather a layer fewer in backward, for the layers' whole parameters held meanwhile
    assert kept.predicted.step_time_s < default.predicted.step_time_s
    assert kept.predicted.peak_memory_bytes > default.predicted.peak_memory_bytes
    assert kept.predicted.comm_bytes < default.predicted.comm_bytes
    again = Plan.from_json(kept.to_json())
    assert again.kept_layers == kept.kept_layers and again.to_json() == kept.to_json()
    # priced as a plan solved under that schedule from the start: False keeps every layer too
    everything = _fsdp(gpt, comm=CommOptions(reshard_after_forward=False))
    assert everything.kept_layers == kept.kept_layers, "a plan records the schedule it is priced for"
    for key in ("step_time_s", "peak_memory_bytes", "comm_bytes"):
        assert getattr(everything.predicted, key) == pytest.approx(getattr(kept.predicted, key), rel=1e-9), key


def test_under_a_budget_the_last_layers_that_fit_are_kept(gpt):
    default = _fsdp(gpt, comm=CommOptions(reshard_after_forward=None))
    every = _fsdp(gpt)
    low, high = default.predicted.peak_memory_bytes, every.predicted.peak_memory_bytes
    budget = low + 0.1 * (high - low)
    plan = _fsdp(gpt, memory_budget=budget)
    kept = plan.kept_layers
    assert plan.memory is None and plan.predicted.peak_memory_bytes <= budget
    assert kept is not None and kept[0] == "" and 0 < len(kept) - 1 < len(LAYERS), kept
    assert kept[1:] == LAYERS[len(LAYERS) - (len(kept) - 1) :], "the last layers, which backward needs first"
    assert every.predicted.step_time_s <= plan.predicted.step_time_s < default.predicted.step_time_s
    # at FSDP2's default's own peak, the layers whose backward comes before it still fit: kept
    # parameters are freed at their backward, before the first layer's (where this plan peaks)
    tight = _fsdp(gpt, memory_budget=low)
    assert tight.predicted.peak_memory_bytes <= low and tight.kept_layers == kept, tight.kept_layers


def test_a_plan_records_the_schedule_it_was_given_and_one_that_gathers_nothing_none(gpt):
    assert _fsdp(gpt, comm=CommOptions(reshard_after_forward=True)).kept_layers == ()
    last = ("", LAYERS[-1])
    assert _fsdp(gpt, comm=CommOptions(reshard_after_forward=last)).kept_layers == last
    model, batch = gpt
    assert autopar.hand_plan("ddp", model, mesh=(8,), example_inputs=batch, cluster="h100-80g").kept_layers is None


def test_the_option_takes_layer_names_and_names_every_value_it_takes():
    assert CommOptions(reshard_after_forward=["", "model.layers.3"]).reshard_after_forward == ("", "model.layers.3")
    assert CommOptions().with_plan(("", "a.0")).reshard_after_forward == ("", "a.0")
    assert CommOptions().with_plan(None).reshard_after_forward is None
    assert CommOptions(reshard_after_forward=True).with_plan(("", "a.0")).reshard_after_forward is True
    with pytest.raises(autopar.ConfigError, match='a tuple of the layers to keep .* or "auto"'):
        CommOptions(reshard_after_forward="yes")


def test_show_and_diff_say_which_layers_are_kept(gpt):
    from autopar.cli.views import diff_blocks, plan_diff
    from autopar.ir.summary import header_lines

    default = _fsdp(gpt, comm=CommOptions(reshard_after_forward=None))
    kept = _fsdp(gpt)
    assert "the root's and 4 layers (transformer.h.0, transformer.h.1, ..., transformer.h.3)" in "\n".join(header_lines(kept))
    assert not any("kept from forward" in line for line in header_lines(default))
    diff = plan_diff(default, kept)
    assert diff["kept_layers"] == {"a": None, "b": ["", *LAYERS]}
    head = diff_blocks(diff, "a.json", "b.json", default, kept)[0]
    assert "kept from forward to backward: the root's (FSDP2's default) -> the root's and 4 layers (transformer.h.0," in head
    resharded = _fsdp(gpt, comm=CommOptions(reshard_after_forward=True))
    assert "no re-gather): none (every layer resharded after forward, the root's too)" in "\n".join(header_lines(resharded))


def test_where_the_allocator_would_run_out_fewer_layers_are_kept_without_solving_again(gpt, monkeypatch):
    from autopar.solver.planners import sharding

    default = _fsdp(gpt, comm=CommOptions(reshard_after_forward=None)).predicted.peak_memory_bytes
    every = _fsdp(gpt).predicted.peak_memory_bytes
    lowered = default + 0.1 * (every - default)
    solves = []
    solve = sharding._solve_sharding
    monkeypatch.setattr(sharding, "_solve_sharding", lambda *args, **kwargs: solves.append(1) or solve(*args, **kwargs))
    # PyTorch's caching allocator, as if it ran out of the device above ``lowered``
    monkeypatch.setattr(
        sharding,
        "allocator_budget",
        lambda plan, budget, asked=None: lowered if plan.predicted.peak_memory_bytes > lowered else None,
    )
    plan = _fsdp(gpt, memory_budget=2 * every)
    assert len(solves) == 1, "the kept layers are chosen again, the sharding is not solved again"
    assert plan.predicted.peak_memory_bytes <= lowered and 0 < len(plan.kept_layers) - 1 < len(LAYERS), plan.kept_layers
    assert plan.kept_layers[1:] == LAYERS[len(LAYERS) - (len(plan.kept_layers) - 1) :]


def test_a_layer_name_that_is_no_layer_of_the_model_is_refused_naming_the_real_ones(gpt):
    with pytest.raises(
        autopar.ConfigError, match=r"names 'transformer\.h\.9', which is no layer of the model.*'transformer\.h\.0'"
    ):
        _fsdp(gpt, comm=CommOptions(reshard_after_forward=("", "transformer.h.9")))


def test_compile_refuses_it_too_before_building_anything(world_of_one):
    model = build_model("gpt", **CONFIG)
    batch = example_batch("gpt", batch_size=2, **CONFIG)
    plan = autopar.hand_plan("fsdp", model, mesh=(1,), example_inputs=batch, cluster="cpu")
    with pytest.raises(autopar.ConfigError, match=r"names 'blocks\.0', which is no layer of the model"):
        autopar.compile(model, (1,), example_inputs=batch, plan=plan, comm=CommOptions(reshard_after_forward=("", "blocks.0")))


def test_the_roots_layer_is_one_where_no_parameter_sits_at_the_root():
    """An ``nn.Sequential`` has no parameter at its root ('0.weight' is layer '0'), but every
    schedule the planner records keeps the root's layer (``""``): compile took it for a misspelt name."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16), torch.nn.Linear(16, 1))
    x = torch.randn(8, 16)
    plan = autopar.hand_plan("fsdp", model, mesh=(2,), example_inputs=(x,), cluster="cpu")
    assert plan.kept_layers is not None and "" in plan.kept_layers, plan.kept_layers
    check_kept_layers(plan.kept_layers, [name for name, _ in model.named_parameters()])
    with pytest.raises(autopar.ConfigError, match=r"names '5', which is no layer"):
        check_kept_layers(("", "5"), [name for name, _ in model.named_parameters()])
