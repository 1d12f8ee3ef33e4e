"""Calls of other input shapes than the example inputs (``autopar.runtime.shapes``): a training loop
over batches of three sequence lengths and a last smaller batch, greedy decoding that grows the
sequence and the model's own ``generate()``, equal to eager on 2 gloo ranks; larger shapes and ranks that disagree are refused.
Other values of arguments that are not tensors get graphs of their own, as other shapes do."""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree

from autopar.errors import InputError
from autopar.ir.data import DataLayout
from autopar.runtime.base import _check_constant, constant_entry
from autopar.runtime.shapes import (
    MANY_GRAPHS,
    call_key,
    examples_of,
    is_call_key,
    key_number,
    relaid,
    shape_key,
    timed_build,
)
from tests.runtime.hf_trainer_job import SEQ, VOCAB, tiny_llama

ROWS = 4


def _llama():
    return tiny_llama()  # the Trainer test's tiny float64 Llama


def _batches() -> list[dict[str, torch.Tensor]]:
    """Three sequence lengths (as a padding collator makes them), then a last smaller batch."""
    generator = torch.Generator().manual_seed(1)
    made = []
    for rows, seq in ((ROWS, SEQ), (ROWS, 12), (ROWS, 8), (ROWS, 12), (3, SEQ)):
        ids = torch.randint(3, VOCAB, (rows, seq), generator=generator)
        made.append({"input_ids": ids, "labels": ids.clone()})
    return made


def _train(model, batches, step_fn) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        step_fn(model)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _greedy(model, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy decoding by calls of the model on the growing sequence (in grad mode, so that the
    compiled module runs its graphs, where under no_grad a replicated plan evaluates locally)."""
    ids = prompt
    for _ in range(steps):
        logits = model(input_ids=ids, labels=ids).logits
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def _run_shapes(rank: int, world: int) -> dict:
    import autopar

    eager = _llama()
    model = copy.deepcopy(eager)
    batches = _batches()
    grads: list[dict] = []
    pm = autopar.compile(model, mesh=(world,), example_kwargs=batches[0], cluster="cpu")
    losses = _train(pm, batches, lambda m: grads.append(m.full_grads()))
    eager_grads: list[dict] = []
    eager_losses = _train(eager, batches, lambda m: eager_grads.append({n: p.grad.clone() for n, p in m.named_parameters()}))
    # Accumulation over shapes under DDP's no_sync() (Trainer's, with a padding collator): the
    # planned shape's held gradients are reduced before another shape's graph runs, and nothing is
    # held where both shapes run in one backward.
    for micro, model_ in enumerate((pm, eager)):
        sync = model_.no_sync() if micro == 0 else contextlib.nullcontext()
        with sync:
            (model_(**batches[0]).loss + model_(**batches[1]).loss).backward()
            for index in (0, 1, 0, 2):
                model_(**batches[index]).loss.backward()
        model_(**batches[3]).loss.backward()
    accumulated, eager_accumulated = pm.full_grads(), {n: p.grad for n, p in eager.named_parameters()}
    pm.zero_grad()
    eager.zero_grad()
    prompt = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(2))
    pm.eval()
    eager.eval()
    tokens, eager_tokens = _greedy(pm, prompt, 4), _greedy(eager, prompt, 4)
    generated = pm.generate(prompt, max_new_tokens=4, do_sample=False)  # the model's own method
    eager_generated = eager.generate(prompt, max_new_tokens=4, do_sample=False)
    with pytest.raises(ValueError, match="planned for shape"):
        pm(input_ids=torch.randint(3, VOCAB, (2, SEQ + 1)), labels=torch.randint(3, VOCAB, (2, SEQ + 1)))
    return {
        "losses": losses,
        "eager_losses": eager_losses,
        "grad_diff": max(
            float((got[name] - want[name]).abs().max() / want[name].abs().max().clamp_min(1e-30))
            for got, want in zip(grads, eager_grads)
            for name in want
        ),
        "param_diff": max(
            float((pm.full_state_dict()[name] - p).abs().max())
            for name, p in eager.state_dict().items()
            if name in pm.full_state_dict()
        ),
        "tokens": tokens,
        "eager_tokens": eager_tokens,
        "generated": generated,
        "eager_generated": eager_generated,
        "accumulated_diff": max(
            float((accumulated[name] - want).abs().max() / want.abs().max()) for name, want in eager_accumulated.items()
        ),
        "graphs": len(pm._by_shape),
        "data_parallel": [run.plan.data_layout.size for run in pm._by_shape.values()] + [pm.data_parallel_size],
    }


@pytest.mark.multiproc
def test_loop_over_changing_shapes_and_greedy_decoding_match_eager(rank_pool) -> None:
    pytest.importorskip("transformers")
    results = rank_pool(2).run(_run_shapes, timeout_s=300)
    for result in results:
        assert result["losses"] == pytest.approx(result["eager_losses"], rel=1e-9)
        assert result["grad_diff"] < 1e-9
        assert result["param_diff"] < 1e-9
        assert result["accumulated_diff"] < 1e-9
        assert torch.equal(result["tokens"], result["eager_tokens"])
        assert torch.equal(result["generated"], result["eager_generated"])
    # 12, 8 and the last 3 rows: three train graphs; decoding's lengths 5 to 8: four eval graphs
    assert results[0]["graphs"] == 7


def test_many_graphs_of_other_shapes_say_what_each_costs(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="autopar"):
        for cached in range(MANY_GRAPHS + 2):
            timed_build(((4, cached + 1),), "train", lambda: None, cached)
    warned = [record for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warned) == 1 and "pass a value that changes at every call" in warned[0].getMessage()
    assert sum("traced and planned the train graph" in record.getMessage() for record in caplog.records) == MANY_GRAPHS + 2


def test_shape_key_numbers_are_stable_and_tell_shapes_apart() -> None:
    one = shape_key([torch.zeros(4, 16), 3, torch.zeros(4)])
    assert one == ((4, 16), constant_entry(3), (4,))
    assert key_number(one) == key_number(((4, 16), constant_entry(3), (4,)))
    assert key_number(one) != key_number(((4, 12), constant_entry(3), (4,)))
    assert key_number(one) != key_number(((4, 16), constant_entry(4), (4,)))  # another value of an argument
    assert key_number(one) != key_number(((4, 16), constant_entry(3.0), (4,)))  # of another type
    assert float(key_number(one)) == key_number(one) and key_number(one) < 2**52


def test_shape_key_numbers_are_the_same_in_every_process() -> None:
    """Ranks compare the numbers: a string argument's must not follow Python's per-process hash seed."""
    code = "from autopar.runtime.shapes import key_number, shape_key; print(key_number(shape_key(['mean', 2.5])))"
    numbers = {
        subprocess.run(
            [sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed}, capture_output=True, text=True, check=True
        ).stdout
        for seed in ("1", "2")
    }
    assert len(numbers) == 1, numbers


def test_a_module_that_runs_only_its_traced_graphs_refuses_another_value() -> None:
    """A pipelined module (no graph per value) checks each call's constants against its graph's."""
    _check_constant("scale", 1.0, constant_entry(1.0))
    with pytest.raises(InputError, match=r"argument 'scale' is 2\.0, but this module runs a graph traced with scale=1\.0"):
        _check_constant("scale", 2.0, constant_entry(1.0))
    with pytest.raises(InputError, match="pass a value that changes as a tensor"):
        _check_constant("flag", 1, constant_entry(True))  # another type: the graph took the branch of True


class _Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x, scale=1.0, how="mean", repeat=1, flag=False):
        y = self.fc(x) * scale
        for _ in range(repeat):
            y = torch.tanh(y)
        y = y + 1 if flag else y
        return y.mean() if how == "mean" else y.sum()


def _run_constants(rank: int, world: int) -> dict:
    """SGD steps with other values of the arguments that are not tensors than the example's, on
    the solver's plan, against eager; and a call whose ranks pass other values."""
    import autopar

    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    eager = _Scaled().double()
    example = dict(x=x, scale=1.0, how="mean", repeat=1, flag=False)
    pm = autopar.compile(copy.deepcopy(eager), (world,), example_kwargs=example, cluster="cpu")
    calls = [{}, {"scale": 0.5}, {"how": "sum"}, {"repeat": 2, "flag": True}, {"scale": 0.5}, {}]
    losses = []
    for module in (pm, eager):
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        for changed in calls:
            loss = module(**{**example, **changed})
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    full = pm.full_state_dict()
    try:
        pm(**{**example, "scale": 1.0 + rank})
        disagreed = "ran"
    except ValueError as error:
        disagreed = str(error)
    return {
        "losses": (losses[: len(calls)], losses[len(calls) :]),
        "param_diff": max(float((full[name] - p).abs().max()) for name, p in eager.state_dict().items()),
        "graphs": len(pm._by_shape),
        "disagreed": disagreed,
    }


@pytest.mark.multiproc
def test_other_values_of_arguments_that_are_not_tensors_run_graphs_of_their_own(rank_pool) -> None:
    """The graph holds such arguments (a scale, a flag, a count, a string) as constants: a call
    with other values ran the example's, without a word."""
    for result in rank_pool(2).run(_run_constants, timeout_s=300):
        got, want = result["losses"]
        assert got == pytest.approx(want, rel=1e-12), result["losses"]
        assert result["param_diff"] < 1e-12
        assert result["graphs"] == 3, "one graph per new set of values, cached"
        assert "passed inputs of different shapes (or other values of an argument" in result["disagreed"], result


def _nanogpt():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "nanogpt"))
    from model import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig()).double()


def _steps(model, batches, calls, own_rows: bool = False) -> list[float]:
    """AdamW steps, each on a loss the way ``calls`` says: the model's (called with its targets), or
    one on the logits of a call without them (nanoGPT's forward then gives the last position's).
    ``own_rows``: each rank passes its rows (the losses are the mean over the ranks)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for (x, y), call in zip(batches, calls):
        if call == "targets":
            loss = model(x, y)[1]
        elif call == "keywords":  # the same arguments, by keyword in another order
            loss = model(targets=y, idx=x)[1]
        else:
            logits = model(x)[0]
            loss = torch.nn.functional.cross_entropy(logits[:, -1], y[:, -1])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach()
        if own_rows:
            torch.distributed.all_reduce(loss)
            loss /= torch.distributed.get_world_size()
        losses.append(loss.item())
    return losses


def _param_diff(pm, eager) -> float:
    full = pm.full_state_dict()
    return max(float((full[name] - p).abs().max()) for name, p in eager.state_dict().items() if name in full)


def _run_arguments(rank: int, world: int) -> dict:
    """nanoGPT's model compiled with its targets, called without them (a loss on its logits, its
    own generate()) and with them by keyword, on an FSDP plan (every rank the whole batch) and on
    the solver's under batch='per_rank' (each rank its rows), against eager; and Hugging Face's
    generate(), which passes other arguments than the example's, on an FSDP plan."""
    import autopar
    from autopar.errors import InputError

    generator = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, 128, (4, 32), generator=generator),) * 2 for _ in range(4)]
    batches = [(x, torch.roll(x, -1, 1)) for x, _ in batches]
    calls = ["targets", "logits", "keywords", "logits"]
    fsdp = autopar.hand_plan("fsdp", _nanogpt(), (world,), example_inputs=batches[0], cluster="cpu")
    sharded = autopar.compile(_nanogpt(), (world,), example_inputs=batches[0], plan=fsdp)
    per_rank = autopar.compile(_nanogpt(), (world,), example_inputs=batches[0], data=autopar.DataOptions(batch="per_rank"))
    rows = [tuple(t[rank * 2 : rank * 2 + 2] for t in batch) for batch in batches]
    eager, eager_rows = _nanogpt(), _nanogpt()
    result = {
        "sharded": (_steps(sharded, batches, calls), _steps(eager, batches, calls)),
        "per_rank": (_steps(per_rank, rows, calls, own_rows=True), _steps(eager_rows, batches, calls)),
        "param_diff": max(_param_diff(sharded, eager), _param_diff(per_rank, eager_rows)),
        "sharded_params": sum(any(p.is_shard() for p in spec) for spec in fsdp.params.values()),
        "data_parallel": per_rank.data_parallel_size,
    }
    # evaluation of a rank's rows by keyword: the call the graph takes (the global batch's loss), as by position
    per_rank.eval(), eager_rows.eval()
    with torch.no_grad():
        by_keyword = per_rank(targets=rows[0][1], idx=rows[0][0])[1].item()
        result["per_rank_eval"] = (by_keyword, per_rank(*rows[0])[1].item(), eager_rows(*batches[0])[1].item())
    sharded.eval(), eager.eval()
    with torch.no_grad():
        torch.manual_seed(5)  # generate() samples: every rank alike
        tokens = sharded.generate(batches[0][0][:, :8], max_new_tokens=3)
        torch.manual_seed(5)
        result["generated"] = (tokens, eager.generate(batches[0][0][:, :8], max_new_tokens=3))
    result["graphs"] = len(sharded._by_shape)
    llama = _llama()
    ids = torch.randint(3, VOCAB, (ROWS, SEQ), generator=generator)
    example = {"input_ids": ids, "labels": ids}
    plan = autopar.hand_plan("fsdp", llama, (world,), example_kwargs=example, cluster="cpu")
    pm = autopar.compile(copy.deepcopy(llama), (world,), example_kwargs=example, plan=plan).eval()
    llama.eval()
    prompt = ids[:2, :5]
    result["hf_generated"] = (
        pm.generate(prompt, max_new_tokens=3, do_sample=False, use_cache=False),
        llama.generate(prompt, max_new_tokens=3, do_sample=False),
    )
    try:
        pm.generate(prompt, max_new_tokens=3, do_sample=False)
        result["cached"] = "ran"
    except InputError as error:
        result["cached"] = str(error)
    return result


@pytest.mark.multiproc
def test_calls_with_other_arguments_than_the_examples_run_graphs_of_their_own(rank_pool) -> None:
    """A module compiled with its targets, called without them, refused the call ("missing
    argument 'targets'"), and so did its own generate() under a plan that shards parameters, and
    the same arguments passed by keyword in another order."""
    pytest.importorskip("transformers")
    for result in rank_pool(2).run(_run_arguments, timeout_s=300):
        assert result["sharded_params"] > 0 and result["data_parallel"] == 2
        assert result["param_diff"] < 1e-10
        by_keyword, by_position, whole_batch = result["per_rank_eval"]
        assert by_keyword == by_position == pytest.approx(whole_batch, rel=1e-10)
        for plan in ("sharded", "per_rank"):
            got, want = result[plan]
            assert got == pytest.approx(want, rel=1e-10), (plan, got, want)
        # the train graph without targets; the eval graphs of the three lengths generate() calls at
        assert result["graphs"] == 4, "the same arguments by keyword run the compiled graph"
        assert torch.equal(*result["generated"]), result["generated"]
        assert torch.equal(*result["hf_generated"]), result["hf_generated"]
        assert "generate(..., use_cache=False)" in result["cached"], result["cached"]


def test_the_same_arguments_passed_another_way_are_laid_out_as_the_examples() -> None:
    def forward(idx, targets=None, *, scale=1.0, **rest):
        pass

    signature = inspect.signature(forward)
    x, y = torch.zeros(2), torch.ones(2)
    planned = pytree.tree_flatten(((x, y), {"scale": 2.0}))[1]
    assert relaid(signature, planned, (), {"scale": 2.0, "targets": y, "idx": x}) == ((x, y), {"scale": 2.0})
    assert relaid(signature, planned, (x,), {"targets": y, "scale": 2.0}) == ((x, y), {"scale": 2.0})
    assert relaid(signature, planned, (x,), {"scale": 2.0}) is None  # targets left out: other arguments
    assert relaid(signature, planned, (x, y), {"scale": 2.0, "mask": x}) is None  # one added
    assert relaid(None, planned, (x,), {"targets": y, "scale": 2.0}) is None  # no signature to tell
    key = call_key(pytree.tree_flatten(((x,), {"scale": 2.0}))[1], [x, 2.0])
    assert is_call_key(key) and not is_call_key(shape_key([x, 2.0])) and key[1:] == shape_key([x, 2.0])
    assert key_number(key) != key_number(shape_key([x, 2.0]))


def test_per_rank_examples_repeat_the_rows_to_the_whole_batch() -> None:
    layout = DataLayout("per_rank", (0,), (2,), ("x",))
    x, mask = torch.ones(3, 5), torch.ones(5)
    args, kwargs = examples_of((x,), {"mask": mask}, [("x", (4, 8), x.dtype), ("mask", (8,), x.dtype)], layout)
    assert args[0].shape == (6, 5) and kwargs["mask"].shape == (5,)
