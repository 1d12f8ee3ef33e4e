"""Mixed precision on real gloo ranks: compiled GPTs against an eager reference under the same policy.

ONE spawn of four ranks runs every case; the ranks return numbers and the parent asserts.
The reference (``tests.conftest.PolicyReference``) is the model run eagerly the way autopar
carries the policy out: fp32 master parameters cast to bf16 once per forward, bf16 inputs and
activations, fp32 gradients in the masters. Where gradients are reduced (fp32, by the
structure of the rewritten graph) is pinned single-process in tests/passes/test_precision.py;
this file checks that the numbers come out right.

Tolerances. In bf16 (8 significant bits) two correct evaluations of one gradient differ far
more than in fp32. Errors are per tensor, ||got - want|| / ||want||. The eager reference on the
whole batch and the same reference summed over four micro-batches of it (a data-parallel split)
differ by up to 3% in the worst tensor of this GPT, and each is up to 4-7% from the fp32
gradient (layer-norm weights; medians 1-2%). So each tensor must match the reference within
10% (a lost or doubled reduction over two or more ranks is off by 50% or more), and, the
sharper check, be no further from the fp32 gradient (computed beside it) than 1.5 times the
reference is, plus 0.5%: measured, the sharded runs are 0.8-1.25 times as far. The loss comes
back in bf16, whose spacing near 8 is 0.0625 (0.8%): it must match within 2%. The fp32
("32-true") case keeps the 1e-4 (largest element error over largest element) of
tests/runtime/test_module.py.

bf16 reductions (FSDP2's default policy: fp32 masters, ``reduce_dtype`` bf16). The reference
(``PolicyReference.data_parallel_backward``) runs the four ranks' quarters of the batch on
their own, rounds each rank's fp32 gradient to bf16 and sums them in bf16 in rank order, as
the runtime's buckets do (gloo sums in its own order). Rounding a rank's gradient to 8
significant bits errs by at most 2**-9 of it, and each of the three bf16 additions by 2**-9
of the partial sum: a few tenths of a percent per tensor in L2, well inside the 10% and the
truth ratio above, while a dropped reduction (one rank's own gradient, which the reference
also returns) is off by far more than 10%, and the parent asserts that it fails the check.
Those two checks cannot tell a bf16 sum from an fp32 one, so a sharper one: a gradient summed
in bf16 and cast to fp32 is a bf16 value, element for element, and an fp32 sum of four bf16
gradients mostly is not (asserted of the "bf16-mixed" DDP case, which reduces in fp32).
Measured (2026-11-24): worst tensor 0.4-1.4% (DDP) and 1.7-2.0% (FSDP) from the reference,
0.8-1.14 times as far from fp32 as it; all 20 (DDP) and 12 (FSDP) gradient tensors bf16 values,
1 of 20 under "bf16-mixed" (the positional table, whose gradient is reduced at the lookup's
output, in bf16); one rank's own gradient 87-92% off. With the bf16 buckets' collectives
dropped (a mutation run: each rank keeps its own sum) the test fails: 88-99% off.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import autopar
from autopar.runtime.tools.launch import max_rel_diff
from autopar.zoo.models import build_model, example_batch
from tests.conftest import PolicyReference, collective_counts, eager_grads

pytestmark = pytest.mark.multiproc

WORLD = 4
# The configurations under which the cpu preset splits the batch (tests/passes/test_schedule.py):
# DDP's gradient all-reduces, and FSDP's gathers whose gradients are reduce-scattered. No biases:
# a key-projection bias has an exactly-zero gradient, noise only (tests/runtime/test_module.py).
CONFIG = dict(vocab_size=1024, block_size=64, n_layer=2, n_head=4, n_embd=128, bias=False)
FSDP_CONFIG = dict(vocab_size=4096, block_size=128, n_layer=1, n_head=8, n_embd=256, bias=False)
BATCH = 16
LR = 1e-3
GRAD_TOL, LOSS_TOL, FP32_TOL = 0.1, 0.02, 1e-4
TRUTH_RATIO, TRUTH_SLACK = 1.5, 0.005
BF16_REDUCE = autopar.MixedPrecision("bfloat16", "bfloat16", "float32", name="bf16-reduce")
# (label, model, plan: a hand plan's kind or "auto" for autopar.compile's own solve, precision, mesh)
CASES = (
    ("ddp_bf16_mixed", "gpt", "ddp", "bf16-mixed", (WORLD,)),
    ("fsdp_bf16_mixed", "gpt", "fsdp", "bf16-mixed", (WORLD,)),
    ("auto_bf16_mixed", "gpt", "auto", autopar.MixedPrecision("bfloat16", "float32", "float32", name="mine"), (2, 2)),
    ("ddp_bf16_true", "gpt", "ddp", "bf16-true", (WORLD,)),
    ("ddp_32_true", "gpt", "ddp", "32-true", (WORLD,)),
    # Floating inputs (and an MSE target) are cast to bf16 like the parameters.
    ("mlp_bf16_mixed", "mlp", "ddp", "bf16-mixed", (WORLD,)),
    # A plan the parent makes under a budget: sharded, and a layer checkpointed whose first node
    # is a parameter's cast (which the precision passes move past its collectives).
    ("checkpointed_bf16_mixed", "gpt", "given", "bf16-mixed", (WORLD,)),
    # FSDP2's default policy: fp32 masters, gradients reduced in bf16 (DDP's all-reduce buckets,
    # FSDP's reduce-scatters), against the reference reducing four ranks' gradients in bf16.
    ("ddp_bf16_reduce", "gpt", "ddp", BF16_REDUCE, (WORLD,)),
    ("fsdp_bf16_reduce", "gpt", "fsdp", BF16_REDUCE, (WORLD,)),
)
REDUCED_IN_BF16 = ("ddp_bf16_reduce", "fsdp_bf16_reduce")


def l2_rel_diff(got: dict, want: dict) -> dict[str, float]:
    """Per name, ||got - want|| / ||want|| (the whole tensor's error, not its worst element)."""
    return {name: ((got[name].double() - want[name].double()).norm() / want[name].double().norm()).item() for name in want}


def _checkpointed_plan() -> autopar.Plan:
    """bf16-mixed GPT on (WORLD,) under half the memory of DDP's layout: sharding alone does not
    fit, so the plan shards and checkpoints. (At 60% sharding alone fits once the ILP prices each
    parameter's gradient reduction once, bucketed. The budget is DDP's, not the fastest plan's:
    that one may shard already, as the ILP prices the optimizer step that sharding saves.)"""
    model = build_model("gpt", seed=0, **CONFIG)
    batch = example_batch("gpt", BATCH, seed=1, vocab_size=CONFIG["vocab_size"], block_size=CONFIG["block_size"])
    kwargs = dict(example_inputs=batch, cluster="cpu", precision="bf16-mixed")
    ddp = autopar.hand_plan("ddp", model, (WORLD,), **kwargs)
    return autopar.plan(model, (WORLD,), memory_budget=0.5 * ddp.predicted.peak_memory_bytes, **kwargs)


def _run_case(name: str, kind: str, precision, mesh: tuple[int, ...], given: str | None = None) -> dict:
    config = {} if name != "gpt" else FSDP_CONFIG if kind == "fsdp" else CONFIG
    model = build_model(name, seed=0, **config)
    reference = PolicyReference(copy.deepcopy(model), precision)
    truth = copy.deepcopy(model)  # fp32 eager: how far each bf16 run is from the exact gradient
    sizes = {key: config[key] for key in ("vocab_size", "block_size") if key in config}
    batch = example_batch(name, BATCH, seed=1, **sizes)
    if kind == "auto":
        pm = autopar.compile(model, mesh, example_inputs=batch, cluster="cpu", precision=precision)
    elif kind == "given":
        pm = autopar.compile(model, mesh, example_inputs=batch, plan=autopar.Plan.from_json(given))
    else:
        plan = autopar.hand_plan(kind, model, mesh, example_inputs=batch, cluster="cpu", precision=precision)
        pm = autopar.compile(model, mesh, example_inputs=batch, plan=plan)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    opt_reference = torch.optim.AdamW(reference.parameters(), lr=LR)
    opt_truth = torch.optim.AdamW(truth.parameters(), lr=LR)
    steps = []
    for _step in range(2):
        opt.zero_grad()
        opt_reference.zero_grad()
        loss = pm(*batch)
        loss.backward()
        dropped = None
        if reference.policy.casts and reference.policy.reduce_dtype != reference.policy.master_dtype:
            want, own = reference.data_parallel_backward(batch, WORLD)  # the ranks' bf16 reduction
        else:
            want = reference(*batch)
            want.backward()
        opt_truth.zero_grad()
        truth(*batch).backward()
        got, wanted, exact = pm.full_grads(), eager_grads(reference.module), eager_grads(truth)
        if reference.policy.casts and reference.policy.reduce_dtype != reference.policy.master_dtype:
            dropped = l2_rel_diff(own, {name: wanted[name] for name in own})
        steps.append(
            {
                "loss": (loss.item(), want.item()),
                "loss_dtype": str(loss.dtype),
                "grad_rel": max_rel_diff(got, wanted),
                "grad_l2": l2_rel_diff(got, wanted),
                "to_truth": (l2_rel_diff(got, exact), l2_rel_diff(wanted, exact)),
                "bf16_values": {name: bool(torch.equal(g, g.bfloat16().to(g.dtype))) for name, g in got.items()},
                "dropped": dropped,
            }
        )
        opt.step()
        opt_reference.step()
        opt_truth.step()
    return {
        "steps": steps,
        "param_dtypes": sorted({str(p.dtype) for p in pm.parameters()}),
        "grad_dtypes": sorted({str(p.grad.dtype) for p in pm.parameters() if p.grad is not None}),
        "collectives": collective_counts(pm),
        "precision": pm.plan.precision.name,
    }


def _run(rank: int, world: int, given: str) -> dict:
    torch.manual_seed(0)
    return {label: _run_case(name, kind, precision, mesh, given) for label, name, kind, precision, mesh in CASES}


def test_bf16_mixed_gpt_matches_its_eager_reference_on_gloo(rank_pool) -> None:
    checkpointed = _checkpointed_plan()
    assert checkpointed.memory is not None and checkpointed.memory.checkpoint, checkpointed.summary()
    assert checkpointed.collective_counts(), "the budgeted plan must shard"
    results = rank_pool(WORLD).run(_run, checkpointed.to_json(), timeout_s=900)
    for rank, by_label in enumerate(results):
        for label, result in by_label.items():
            fp32 = label.endswith("32_true")
            for step, numbers in enumerate(result["steps"], start=1):
                where = f"rank {rank} {label} step {step}"
                got, want = numbers["loss"]
                assert math.isclose(got, want, rel_tol=FP32_TOL if fp32 else LOSS_TOL), f"{where}: loss {got} vs eager {want}"
                if fp32:
                    worst = max(numbers["grad_rel"], key=numbers["grad_rel"].get)
                    assert numbers["grad_rel"][worst] < FP32_TOL, (
                        f"{where}: gradient of {worst} off by {numbers['grad_rel'][worst]:.2e}"
                    )
                    continue
                worst = max(numbers["grad_l2"], key=numbers["grad_l2"].get)
                assert numbers["grad_l2"][worst] < GRAD_TOL, (
                    f"{where}: gradient of {worst} off by {numbers['grad_l2'][worst]:.2e}"
                )
                ours, reference = numbers["to_truth"]
                for name in ours:
                    assert ours[name] <= TRUTH_RATIO * reference[name] + TRUTH_SLACK, (
                        f"{where}: gradient of {name} is {ours[name]:.2e} from the fp32 one, the eager bf16 "
                        f"run {reference[name]:.2e}"
                    )
            first, second = (s["loss"][0] for s in result["steps"])
            assert second < first, f"rank {rank} {label}: the step did not reach the next forward ({first} -> {second})"
    first = results[0]
    for label in REDUCED_IN_BF16:
        for step, numbers in enumerate(first[label]["steps"], start=1):
            # Summed in bf16, cast to fp32: every reduced gradient is a bf16 value in fp32.
            odd = [name for name, exact in numbers["bf16_values"].items() if not exact]
            assert not odd, f"{label} step {step}: gradients of {odd} were not reduced in bf16"
            # The gradient check has teeth: one rank's own gradient (the reduction dropped) fails it.
            assert max(numbers["dropped"].values()) > GRAD_TOL, (label, step, numbers["dropped"])
    # ... and the bf16 check too: fp32 sums of bf16 gradients are mostly not bf16 values.
    fp32_sums = first["ddp_bf16_mixed"]["steps"][0]["bf16_values"]
    assert sum(fp32_sums.values()) < len(fp32_sums) / 2, fp32_sums
    # Master weights and their gradients in fp32; bf16-true keeps no master copy.
    for label in (
        "ddp_bf16_mixed",
        "fsdp_bf16_mixed",
        "auto_bf16_mixed",
        "ddp_32_true",
        "mlp_bf16_mixed",
        "checkpointed_bf16_mixed",
    ) + REDUCED_IN_BF16:
        assert first[label]["param_dtypes"] == ["torch.float32"] == first[label]["grad_dtypes"], (label, first[label])
    assert first["ddp_bf16_true"]["param_dtypes"] == ["torch.bfloat16"] == first["ddp_bf16_true"]["grad_dtypes"]
    # The loss comes back in the dtype the model computes it in: bf16 logits give a bf16 loss.
    assert first["ddp_bf16_mixed"]["steps"][0]["loss_dtype"] == "torch.bfloat16"
    assert first["ddp_32_true"]["steps"][0]["loss_dtype"] == "torch.float32"
    assert first["auto_bf16_mixed"]["precision"] == "mine"
    # The plans communicate: DDP's gradient all-reduces, FSDP's gathers.
    assert first["ddp_bf16_mixed"]["collectives"].get("allreduce_grad"), first["ddp_bf16_mixed"]["collectives"]
    assert first["fsdp_bf16_mixed"]["collectives"].get("all_gather"), first["fsdp_bf16_mixed"]["collectives"]
    assert first["ddp_bf16_reduce"]["collectives"].get("allreduce_grad"), first["ddp_bf16_reduce"]["collectives"]
    assert first["fsdp_bf16_reduce"]["collectives"].get("all_gather"), first["fsdp_bf16_reduce"]["collectives"]
