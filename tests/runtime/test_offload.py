"""Offload under a precision policy (autopar/runtime/offload.py, passes/memory.py): "bf16-mixed"
keeps fp32 masters and AdamW state in the store, fetches the bf16 compute copy, and sends fp32
gradients back. Compared with the same plan without offload (its checkpointing kept), whose
numbers tests/runtime/test_precision.py pins against eager bf16-mixed, over several AdamW steps.

Tolerances. Without a tied weight the offloaded run is the same arithmetic as the resident one:
each fetch reads exactly the cast the resident graph computes, and its gradient is the cast's
backward. A tied weight (GPT's ``wte``/``lm_head``) is fetched once per use, so its two bf16
gradients are summed in fp32 in the store instead of in bf16 before the cast: measured
(2026-11-28) 0.14% (L2) off in that tensor, and 0.2% in the worst weight after three AdamW
steps at lr 1e-2. The bounds, 1% for gradients and 2% for weights, sit far under what a lost
gradient (100%) or a stale compute copy (the weights would not move: the loss would not fall
like the reference's) would give. Losses come back in bf16 (spacing 0.8% near 5): within 2%.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

import autopar
from autopar.errors import ConfigError, UsageError
from autopar.zoo.models import GPT
from tests.conftest import PolicyReference

STEPS = 3
GRAD_TOL, WEIGHT_TOL, LOSS_TOL = 0.01, 0.02, 0.02


def _gpt() -> tuple[GPT, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = GPT(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64, bias=False)
    gen = torch.Generator().manual_seed(1)
    return model, (torch.randint(0, 256, (4, 32), generator=gen), torch.randint(0, 256, (4, 32), generator=gen))


@pytest.fixture(scope="module")
def bf16_offload_plan() -> autopar.Plan:
    """bf16-mixed under 40% of the unbounded peak: a layer checkpointed; parameters, gradients and
    optimizer state offloaded, to host memory (the store a GPU gets)."""
    model, batch = _gpt()
    kwargs = dict(example_inputs=batch, cluster="cpu", precision="bf16-mixed")
    free = autopar.plan(model, (1,), memory_budget=float("inf"), **kwargs)
    plan = autopar.plan(model, (1,), memory_budget=0.4 * free.predicted.peak_memory_bytes, offload="auto", **kwargs)
    return dataclasses.replace(plan, memory=dataclasses.replace(plan.memory, target="cpu"))


def _l2(got: dict, want: dict) -> dict[str, float]:
    return {k: ((got[k].double() - want[k].double()).norm() / want[k].double().norm()).item() for k in want}


def _run(plan: autopar.Plan, reference: bool = False) -> dict:
    model, batch = _gpt()
    if reference:  # eager, the way autopar carries bf16-mixed out
        module = PolicyReference(model, "bf16-mixed")
        opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    else:
        module = autopar.compile(model, tuple(plan.mesh_shape), example_inputs=batch, plan=plan)
        opt = autopar.optim.AdamW(module, lr=1e-2)
    losses, grads, norms = [], None, []
    for step in range(STEPS):
        loss = module(*batch)
        loss.backward()
        losses.append(loss.item())
        if step == 0:
            grads = {n: p.grad for n, p in module.module.named_parameters()} if reference else module.full_grads()
            grads = {n: g.clone() for n, g in grads.items()}  # before clipping scales them in place
        # torch's clipping, as a loop writes it: it binds here (the norm starts near 1.6), and
        # reads the offloaded gradients through their stand-ins (DTensors on two ranks)
        norm = torch.nn.utils.clip_grad_norm_(module.parameters(), 0.5)
        norms.append(float(norm.full_tensor() if isinstance(norm, DTensor) else norm))
        opt.step()
        opt.zero_grad()
    weights = module.module.state_dict() if reference else module.full_state_dict()
    module.eval()  # a validation pass at a shorter length: the eval graph fetches what is offloaded
    with torch.no_grad():
        losses.append(float(module(*(t[:, :16].contiguous() for t in batch))))
    module.train()
    return {"losses": losses, "grads": grads, "weights": weights, "module": module, "norms": norms}


def test_bf16_mixed_offload_equals_the_resident_plan(world_of_one, bf16_offload_plan):
    plan = bf16_offload_plan
    assert {entry.kind for entry in plan.memory.offload} == {"param", "grad", "optimizer_state"}, plan.summary()
    assert plan.memory.checkpoint
    resident = _run(dataclasses.replace(plan, memory=dataclasses.replace(plan.memory, offload=())))
    offloaded = _run(plan)
    reference = _run(plan, reference=True)
    pm = offloaded["module"]

    # The fetches read the bf16 copies: no cast of an offloaded parameter is left on the device.
    code = pm.graph_module.code + "".join(m.code for n, m in pm.graph_module.named_modules() if n.endswith("body"))
    assert "dtype = torch.bfloat16" in code and "key = 'transformer.h.1.mlp.c_fc.weight'" in code
    store = pm.offloader.store
    for fqn in plan.memory.offloaded("param"):
        shape, dtype = store.meta[f"param/{fqn}"]
        assert dtype == torch.float32 and store.meta[f"param/{fqn}@bfloat16"] == (shape, torch.bfloat16)
    for fqn in plan.memory.offloaded("optimizer_state"):
        assert store.meta[f"exp_avg/{fqn}"][1] == torch.float32
    for got, want in zip(offloaded["losses"], resident["losses"]):
        assert abs(got - want) <= LOSS_TOL * abs(want)
    grads = _l2(offloaded["grads"], resident["grads"])
    assert max(grads.values()) < GRAD_TOL, grads
    untied = {k: v for k, v in grads.items() if k not in ("transformer.wte.weight", "lm_head.weight")}
    assert max(untied.values()) == 0.0, untied  # the same arithmetic, bit for bit
    weights = _l2(offloaded["weights"], resident["weights"])
    assert max(weights.values()) < WEIGHT_TOL, weights
    # ... and the resident plan is eager bf16-mixed (tests/runtime/test_precision.py's bounds)
    for got, want in zip(offloaded["losses"], reference["losses"]):
        assert abs(got - want) <= LOSS_TOL * abs(want)
    assert offloaded["losses"][-1] < offloaded["losses"][0]
    # The stored bf16 copy is the stepped master's: rewritten with it at every step.
    fqn = plan.memory.offloaded("param")[0]
    assert torch.equal(store.get(f"param/{fqn}@bfloat16"), store.get(f"param/{fqn}").bfloat16())


def test_a_fetched_bf16_parameter_is_not_kept_from_forward_to_backward(world_of_one, bf16_offload_plan):
    """Ops that save an offloaded weight (linear) save the fetched bf16 copy, which the offloader's
    saved-tensor hooks replace by its key and read again in backward."""
    model, batch = _gpt()
    pm = autopar.compile(model, (1,), example_inputs=batch, plan=bf16_offload_plan)
    offloader = pm.offloader
    unpacked: list = []
    unpack = offloader._unpack

    def spy(packed):
        if isinstance(packed, tuple):
            unpacked.append(packed[0])
        return unpack(packed)

    offloader._unpack = spy
    pm(*batch).backward()
    # Layer 1 is not checkpointed: its offloaded matmul weights are read again in backward, in bf16.
    assert ("transformer.h.1.mlp.c_fc.weight", torch.bfloat16) in unpacked, unpacked
    assert all(dtype == torch.bfloat16 for _, dtype in unpacked), unpacked


def test_a_32_true_offload_graph_fetches_the_stored_dtype(world_of_one):
    model, batch = _gpt()
    free = autopar.plan(model, (1,), example_inputs=batch, cluster="cpu", memory_budget=float("inf"))
    plan = autopar.plan(
        model, (1,), example_inputs=batch, cluster="cpu", memory_budget=0.4 * free.predicted.peak_memory_bytes, offload="auto"
    )
    plan = dataclasses.replace(plan, memory=dataclasses.replace(plan.memory, target="cpu"))
    assert plan.memory.offloaded("param")
    pm = autopar.compile(copy.deepcopy(model), (1,), example_inputs=batch, plan=plan)
    assert (
        "self.offload(" in pm.graph_module.code and "dtype" not in pm.graph_module.code.split("self.offload(")[1].split("\n")[0]
    )
    assert not [key for key in pm.offloader.store.meta if "@" in key]


def _two_rank_run(rank: int, world_size: int, plan_json: str) -> dict:
    plan = autopar.Plan.from_json(plan_json)
    resident = dataclasses.replace(plan, memory=dataclasses.replace(plan.memory, offload=()))
    runs = {"offloaded": _run(plan), "resident": _run(resident)}
    return {
        "losses": (runs["offloaded"]["losses"], runs["resident"]["losses"]),
        "norms": (runs["offloaded"]["norms"], runs["resident"]["norms"]),
        "grads": _l2(runs["offloaded"]["grads"], runs["resident"]["grads"]),
        "weights": _l2(runs["offloaded"]["weights"], runs["resident"]["weights"]),
    }


@pytest.mark.multiproc  # ~15 s: two ranks, each compiling and training the plan with and without offload
def test_bf16_mixed_offload_of_sharded_parameters_on_two_ranks(rank_pool):
    """Sharded, then offloaded: a parameter's collectives stand between its fetch and its cast,
    so the fetch reads the fp32 master and the cast stays after them (``passes.memory``)."""
    model, batch = _gpt()
    kwargs = dict(example_inputs=batch, cluster="cpu", precision="bf16-mixed")
    free = autopar.plan(model, (2,), memory_budget=float("inf"), **kwargs)
    plan = autopar.plan(model, (2,), memory_budget=0.25 * free.predicted.peak_memory_bytes, offload="auto", **kwargs)
    assert plan.memory is not None and plan.memory.offloaded("param"), plan.summary()
    assert any(not p.is_replicate() for fqn in plan.memory.offloaded("param") for p in plan.params[fqn])
    plan = dataclasses.replace(plan, memory=dataclasses.replace(plan.memory, target="cpu"))
    for result in rank_pool(2).run(_two_rank_run, plan.to_json(), timeout_s=300):
        for got, want in zip(*result["losses"]):
            assert abs(got - want) <= LOSS_TOL * abs(want)
        for got, want in zip(*result["norms"], strict=True):  # torch's clipping, through the stand-ins
            assert abs(got - want) <= GRAD_TOL * want, result["norms"]
        assert max(result["grads"].values()) < GRAD_TOL, result["grads"]
        assert max(result["weights"].values()) < WEIGHT_TOL, result["weights"]


def test_loading_weights_into_an_offloading_module_reaches_the_store(world_of_one, bf16_offload_plan, tmp_path):
    """An offloaded parameter's shard is a copy read from the store: ``load_state_dict`` and
    ``autopar.checkpoint.load`` write what they load back, and the bf16 copy follows."""
    model, batch = _gpt()
    pm = autopar.compile(model, (1,), example_inputs=batch, plan=bf16_offload_plan)
    pm(*batch)  # makes the bf16 copies, which a load must rewrite
    loaded = {k: v + 0.01 * torch.randn_like(v) for k, v in pm.full_state_dict().items()}
    loaded["lm_head.weight"] = loaded["transformer.wte.weight"]  # tied
    pm.load_state_dict(loaded)
    got = pm.full_state_dict()
    assert all(torch.equal(got[k], loaded[k]) for k in loaded)
    fqn = bf16_offload_plan.memory.offloaded("param")[0]
    assert torch.equal(pm.offloader.store.get(f"param/{fqn}@bfloat16"), loaded[fqn].bfloat16())
    autopar.checkpoint.save(tmp_path / "ckpt", pm)
    other = autopar.compile(_gpt()[0], (1,), example_inputs=batch, plan=bf16_offload_plan)
    autopar.checkpoint.load(tmp_path / "ckpt", other)
    got = other.full_state_dict()
    assert all(torch.equal(got[k], loaded[k]) for k in loaded)
    assert torch.equal(other(*batch), pm(*batch))
    # DCP's own way: load in place into pm.state_dict(), whose offloaded entries are copies read
    # from the store; the next forward (or step, or state dict) takes what was written back
    third = autopar.compile(_gpt()[0], (1,), example_inputs=batch, plan=bf16_offload_plan)
    third(*batch)
    state = third.state_dict()
    dcp.load({"model": state}, checkpoint_id=tmp_path / "ckpt")  # autopar.checkpoint.save's layout
    assert torch.equal(third(*batch), pm(*batch)), "the loaded weights reached the offloaded parameters"
    assert torch.equal(third.offloader.store.get(f"param/{fqn}@bfloat16"), loaded[fqn].bfloat16())
    got = third.full_state_dict()
    assert all(torch.equal(got[k], loaded[k]) for k in loaded)


def test_the_model_passed_to_compile_loads_into_the_store_and_refuses_what_it_cannot_do(world_of_one, bf16_offload_plan):
    """Through the pre-wrap name (a DDP script's ``model`` beside ``ddp_model``): a load reaches
    the offloaded parameters (``runtime.stale_model``); clipping, zeroing or freezing its
    parameters, which no resident twin stands behind here, is refused naming the fix
    (``runtime.originals``), where before the clip measured 0.0 and scaled nothing."""
    model, batch = _gpt()
    pm = autopar.compile(model, (1,), example_inputs=batch, plan=bf16_offload_plan)
    loaded = {k: v + 0.01 * torch.randn_like(v) for k, v in model.state_dict().items()}
    loaded["lm_head.weight"] = loaded["transformer.wte.weight"]  # tied
    model.load_state_dict(loaded)
    fqn = bf16_offload_plan.memory.offloaded("param")[0]
    assert torch.equal(pm.offloader.store.get(f"param/{fqn}"), loaded[fqn])
    got = pm.full_state_dict()
    assert all(torch.equal(got[k], loaded[k]) for k in loaded)
    pm(*batch).backward()
    with pytest.raises(UsageError, match=r"read or clear its gradient.*an offloading plan.*pm\.clip_grad_norm_"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(UsageError, match=r"freeze or unfreeze it"):
        model.transformer.requires_grad_(False)
    model.requires_grad_(True)  # what it is already: nothing to refuse
    assert pm.clip_grad_norm_(1.0) > 0


def _float64_offload_plan() -> tuple[GPT, tuple[torch.Tensor, torch.Tensor], autopar.Plan]:
    """The GPT in float64 (exact comparisons with eager) and its plan under 40% of its unbounded
    peak, which offloads parameters, gradients and AdamW state to disk and checkpoints layers."""
    model, batch = _gpt()
    model = model.double()
    free = autopar.plan(model, (1,), example_inputs=batch, cluster="cpu")
    plan = autopar.plan(
        model, (1,), example_inputs=batch, cluster="cpu", memory_budget=0.4 * free.predicted.peak_memory_bytes, offload="auto"
    )
    return model, batch, plan


def test_a_loop_that_clips_accumulates_and_zeroes_the_module_trains_as_eager(world_of_one, tmp_path):
    # float64, everything the 40% budget offloads (parameters, gradients, AdamW state): two
    # micro-batches a step, clipping by torch's clip_grad_norm_ (HF's Trainer's) and by
    # pm.clip_grad_norm_ in turn, pm.zero_grad() (the Trainer's too) with both of its modes, and an
    # edit of the gradients through views.
    # Before, pm.zero_grad() left the stored gradients to sum over the steps (0.022 off eager
    # after three), and torch's clip_grad_norm_(pm.parameters()) clipped the resident gradients
    # alone by their own norm (0.006 off after one step): neither said a word.
    model, batch, plan = _float64_offload_plan()
    eager = copy.deepcopy(model)
    assert {entry.kind for entry in plan.memory.offload} == {"param", "grad", "optimizer_state"}
    pm = autopar.compile(model, (1,), example_inputs=batch, plan=plan, offload=f"disk:{tmp_path}")
    opt, eager_opt = autopar.optim.AdamW(pm, lr=1e-2), torch.optim.AdamW(eager.parameters(), lr=1e-2)
    offloaded = [p for n, p in pm.module.named_parameters() if n in plan.memory.offloaded("grad")]
    for step in range(STEPS):
        for _ in range(2):
            (pm(*batch) / 2).backward()
            (eager(*batch) / 2).backward()
        assert "in the offload store" in repr(offloaded[0].grad)
        if step == 0:  # a foreach op over a list that mixes stand-ins and resident gradients (CUDA's clipping)
            got = torch._foreach_norm([p.grad for p in pm.parameters()])
            want = torch._foreach_norm([p.grad for p in eager.parameters()])
            torch.testing.assert_close(list(got), list(want), rtol=1e-12, atol=0)
        if step == 2:  # a loop's own edit, through views of .grad: it reaches the store
            for module in (pm, eager):
                for param in module.parameters():
                    param.grad.view(-1)[:7].mul_(3.0)
        clip = torch.nn.utils.clip_grad_norm_ if step != 1 else lambda params, max_norm: pm.clip_grad_norm_(max_norm)
        norm, want = clip(pm.parameters(), 0.5), torch.nn.utils.clip_grad_norm_(eager.parameters(), 0.5)
        torch.testing.assert_close(norm, want, rtol=1e-12, atol=0, msg=f"norm at step {step}")
        opt.step()
        eager_opt.step()
        pm.zero_grad(set_to_none=step != 1)
        eager.zero_grad()
    want = eager.state_dict()
    for fqn, value in pm.full_state_dict().items():
        torch.testing.assert_close(value, want[fqn], rtol=1e-10, atol=1e-10, msg=f"{fqn} after {STEPS} steps")


def test_autopar_adamw_takes_torch_adamws_arguments(world_of_one, tmp_path):
    # The class swapped, the arguments kept: param groups with their own weight decay and lr over
    # an offloading module step as torch's AdamW over the same groups of the eager model.
    model, batch, plan = _float64_offload_plan()
    eager, other = copy.deepcopy(model), copy.deepcopy(model)
    pm = autopar.compile(model, (1,), example_inputs=batch, plan=plan, offload=f"disk:{tmp_path / 'a'}")

    def groups(module):  # nanoGPT's: decay the matrices, not the biases and norms
        params = dict(module.named_parameters())
        return [
            {"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0, "lr": 3e-2},
        ]

    opt, eager_opt = autopar.optim.AdamW(groups(pm)[:1], lr=1e-2), torch.optim.AdamW(groups(eager), lr=1e-2)
    opt.add_param_group(groups(pm)[1])  # added after construction, as a loop unfreezing layers does
    # an offloaded parameter's stub has its dims (no elements), so it falls in its own group
    assert any(fqn in plan.memory.offloaded("param") and p.numel() == 0 and p.dim() == 2 for fqn, p in opt.params)
    assert [[n for n, p in eager.named_parameters() if any(p is q for q in g["params"])] for g in eager_opt.param_groups] == [
        [n for n, p in pm.named_parameters() if any(p is q for q in g["params"])] for g in opt.param_groups
    ]
    for _ in range(2):
        for module, optimizer in ((pm, opt), (eager, eager_opt)):
            module(*batch).backward()
            optimizer.step()
            optimizer.zero_grad()
    want = eager.state_dict()
    for fqn, value in pm.full_state_dict().items():
        torch.testing.assert_close(value, want[fqn], rtol=1e-10, atol=1e-10, msg=fqn)
    second = autopar.compile(other, (1,), example_inputs=batch, plan=plan, offload=f"disk:{tmp_path / 'b'}")
    with pytest.raises(ConfigError, match="parameters of 2 compiled modules: build one optimizer per module"):
        autopar.optim.AdamW([*pm.parameters(), *second.parameters()])
    with pytest.raises(ConfigError, match="parameters of another compiled module"):
        opt.add_param_group({"params": list(second.parameters())})
    assert len(opt.param_groups) == 2


def test_autopar_adamw_takes_the_rest_of_torch_adamws_signature():
    # named parameters, maximize, and the kernel choices (foreach, fused) as torch's AdamW takes
    # them; what it cannot keep as the plan priced (amsgrad's third moment) is refused by name.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)).double()
    eager = copy.deepcopy(model)
    x = torch.randn(4, 6, dtype=torch.float64)
    opt = autopar.optim.AdamW(model.named_parameters(), lr=1e-2, maximize=True, fused=True, foreach=False)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-2, maximize=True)
    for _ in range(3):
        for module, optimizer in ((model, opt), (eager, eager_opt)):
            module(x).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    for got, want in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ConfigError, match="does not take amsgrad=True"):
        autopar.optim.AdamW(model.parameters(), amsgrad=True)
    with pytest.raises(ConfigError, match=r"does not take capturable=True"):
        autopar.optim.AdamW(model.parameters(), capturable=True)
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['momentum'\]"):
        autopar.optim.AdamW(model.parameters(), momentum=0.9)
    saved = torch.optim.AdamW(eager.parameters(), amsgrad=True).state_dict()  # a state it would not step
    with pytest.raises(ConfigError, match="does not take amsgrad=True"):
        opt.load_state_dict(saved)


@contextlib.contextmanager
def _device_reads(pm) -> Iterator[list[str]]:
    """The keys of ``pm``'s offload store read onto the compute device inside (``Store.get``)."""
    store, reads = pm.offloader.store, []
    get = store.get
    store.get = lambda key: reads.append(key) or get(key)
    try:
        yield reads
    finally:
        del store.get


def test_autopar_adamw_is_a_torch_optimizer_that_schedules_saves_and_resumes(world_of_one, tmp_path):
    # An offloading module's documented optimizer under what a fine-tuning loop does: an LR
    # schedule, a checkpoint of module and optimizer (the offloaded moments read from the store)
    # and a resume in a new module; before, each raised AttributeError (no param_groups).
    model, batch, plan = _float64_offload_plan()
    eager, fresh = copy.deepcopy(model), copy.deepcopy(model)
    assert plan.memory.offloaded("optimizer_state")

    def trainer(module, optimizer_type):
        optimizer = (
            optimizer_type(module, lr=1e-2)
            if optimizer_type is autopar.optim.AdamW
            else optimizer_type(module.parameters(), lr=1e-2)
        )
        return module, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (s + 1))

    def train(run, steps):
        module, optimizer, schedule = run
        for _ in range(steps):
            module(*batch).backward()
            optimizer.step()
            optimizer.zero_grad()
            schedule.step()

    pm = trainer(
        autopar.compile(model, (1,), example_inputs=batch, plan=plan, offload=f"disk:{tmp_path / 'a'}"), autopar.optim.AdamW
    )
    reference = trainer(eager, torch.optim.AdamW)
    train(pm, 2)
    train(reference, 2)
    with _device_reads(pm[0]) as reads:  # a state dict's offloaded tensors go to the host, not the device
        saved = pm[1].state_dict()
        model_state = pm[0].state_dict()
        autopar.checkpoint.save(tmp_path / "ckpt", pm[0], pm[1])
    assert reads == [], "the device has no room for every offloaded tensor at once"
    want = reference[1].state_dict()
    assert len(saved["state"]) == len(want["state"]) and saved["param_groups"][0]["lr"] == want["param_groups"][0]["lr"]
    for fqn in plan.memory.offloaded("param"):
        torch.testing.assert_close(model_state[fqn].to_local(), eager.state_dict()[fqn], rtol=1e-10, atol=1e-10)
    resumed = trainer(
        autopar.compile(fresh, (1,), example_inputs=batch, plan=plan, offload=f"disk:{tmp_path / 'b'}"), autopar.optim.AdamW
    )
    with _device_reads(resumed[0]) as reads:
        autopar.checkpoint.load(tmp_path / "ckpt", resumed[0], resumed[1])
    assert reads == []
    resumed[2].load_state_dict(pm[2].state_dict())
    train(resumed, 2)
    train(reference, 2)
    want = eager.state_dict()
    for fqn, value in resumed[0].full_state_dict().items():
        torch.testing.assert_close(value, want[fqn], rtol=1e-10, atol=1e-10, msg=f"{fqn} after a resume")


def test_an_offloading_module_trains_at_shorter_lengths_and_evaluates_at_any_as_eager(world_of_one, tmp_path):
    # Training batches padded to their own longest row (32, 16, 24 tokens) under the compiled
    # graph's memory decisions (its checkpoint segments too), and a validation pass in eval mode
    # under no_grad after each step, whose graph fetches the offloaded parameters as the trained
    # graph does. Before, all but the compiled shape and mode were refused.
    model, batch, plan = _float64_offload_plan()
    eager = copy.deepcopy(model)
    assert plan.memory.offloaded("param") and plan.memory.checkpoint
    pm = autopar.compile(model, (1,), example_inputs=batch, plan=plan, offload=f"disk:{tmp_path}")
    opt, eager_opt = autopar.optim.AdamW(pm, lr=1e-2), torch.optim.AdamW(eager.parameters(), lr=1e-2)
    for step, length in enumerate((32, 16, 24)):
        inputs = tuple(t[:, :length].contiguous() for t in batch)
        for module, optimizer in ((pm, opt), (eager, eager_opt)):
            module.train()
            module(*inputs).backward()
            optimizer.step()
            optimizer.zero_grad()
            module.eval()
        with torch.no_grad():
            for length in (32, 16):
                inputs = tuple(t[:, :length].contiguous() for t in batch)
                torch.testing.assert_close(pm(*inputs), eager(*inputs), rtol=1e-12, atol=0, msg=f"step {step}, {length} tokens")
    want = eager.state_dict()
    for fqn, value in pm.full_state_dict().items():
        torch.testing.assert_close(value, want[fqn], rtol=1e-10, atol=1e-10, msg=fqn)
    trained = [run for (mode, _), run in pm._by_shape.items() if mode.training]
    assert len(trained) == 2  # 16 and 24 tokens, each checkpointing and fetching as the compiled graph
    assert all(
        "self.checkpoint_0(" in getattr(pm, run.attr).code and "self.offload(" in getattr(pm, run.attr).code for run in trained
    )


def test_a_shorter_graph_the_memory_decisions_do_not_fit_is_refused_naming_the_padding(world_of_one, tmp_path, monkeypatch):
    # Where a shape's graph lacks a node the compiled graph's checkpoint segments name, the
    # decisions cannot be carried over: refused, not run without them (over the budget).
    import autopar.runtime.single as single
    from autopar.errors import PlanError

    model, batch, plan = _float64_offload_plan()
    pm = autopar.compile(model, (1,), example_inputs=batch, plan=plan, offload=f"disk:{tmp_path}")

    def lacking(gm, made, passes):
        raise PlanError("checkpoint segment x .. y: node x is not in the rewritten graph")

    monkeypatch.setattr(single, "run_passes", lacking)
    with pytest.raises(
        PlanError, match=r"other shapes than the example's: this plan offloads.*node x is not.*Pad every training batch"
    ):
        pm(*(t[:, :16].contiguous() for t in batch))


def test_a_host_copy_stays_on_the_host_in_a_dtensor_of_a_device_mesh(world_of_one):
    # An offloaded shard's state-dict copy lies on the host; on a GPU mesh DTensor.from_local
    # would move it onto the device, every one of them at once (the device has no room for them).
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from autopar.runtime.checkpoint import to_dtensor

    on_gpu = copy.copy(init_device_mesh("cpu", (1,)))
    on_gpu._device_type = "cuda"  # as the mesh of a GPU run
    local = torch.arange(12.0).reshape(3, 4)
    got = to_dtensor(local, (Shard(0),), (3, 4), on_gpu)
    assert got.to_local().device.type == "cpu" and got.to_local().data_ptr() == local.data_ptr()
    assert got.shape == (3, 4) and got.placements == (Shard(0),) and got.device_mesh is on_gpu
