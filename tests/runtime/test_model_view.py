"""``pm`` is the user's model, distributed: ``pm.module`` is of the model's class, its attributes
and methods reach through ``pm``, calling the model runs the compiled forward, its
``state_dict()`` is the whole one; the ranks agree on each call (``runtime.data.check_same_call``)."""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

import autopar
from autopar.ops.params import local_of
from autopar.runtime.data import PartialCallError, check_same_call

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "nanogpt"))
from model import GPT, GPTConfig  # noqa: E402


@pytest.fixture()
def gpt_pair(world_of_one):
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    eager = copy.deepcopy(model)
    batch = (torch.randint(0, 128, (4, 32)), torch.randint(0, 128, (4, 32)))
    return autopar.compile(model, (1,), example_inputs=batch, cluster="cpu"), eager, batch


def test_the_models_attributes_and_methods_reach_through(gpt_pair):
    pm, eager, batch = gpt_pair
    assert isinstance(pm.module, GPT) and type(pm.module).__name__ == "DistributedGPT"
    assert pm.config == eager.config and pm.module.config is pm.config
    assert pm.get_num_params() == eager.get_num_params() and pm.module.get_num_params(False) == eager.get_num_params(False)
    # What a method that reads a parameter sees: the parameter pm trains (plain where the plan
    # replicates every parameter, as here on one rank; a DTensor where it shards one).
    assert pm.transformer.wte.weight is dict(pm.named_parameters())["transformer.wte.weight"]
    assert not isinstance(pm.transformer.wte.weight, DTensor)
    assert pm.lm_head.weight is pm.transformer.wte.weight  # ties stay ties
    assert pm.estimate_mfu(4, 0.5) == pytest.approx(eager.estimate_mfu(4, 0.5))
    optimizer = pm.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")  # on pm's own parameters
    assert {id(p) for group in optimizer.param_groups for p in group["params"]} == {id(p) for p in pm.parameters()}
    with pytest.raises(
        AttributeError, match=r"'ParallelModule' object has no attribute 'nothing', and neither has the model \(GPT\)"
    ):
        _ = pm.nothing
    # calling the model (pm.module(...), self(...) in its methods) runs the compiled forward
    assert torch.equal(pm.module(*batch)[1], pm(*batch)[1])
    # the model's name, as code that tells models apart by it reads it (Trainer's label smoother)
    assert pm._get_name() == eager._get_name() == "GPT" and repr(pm).startswith("ParallelModule(GPT(")


def test_modules_are_named_as_the_parameters_are(gpt_pair):
    # Code that pairs modules with parameters by name: Hugging Face Trainer's weight-decay groups
    # walk named_children() and keep the names named_parameters() gives; with ``module.`` in front
    # of the first only, every parameter went to the no-decay group, without a word.
    pm, eager, _ = gpt_pair
    assert [n for n, _ in pm.named_children()] == [n for n, _ in eager.named_children()]
    names = [(n, type(m).__name__.removeprefix("Distributed")) for n, m in pm.named_modules()]
    assert names[1:] == [(n, type(m).__name__) for n, m in eager.named_modules()][1:] and names[0][0] == ""

    def paired(model):  # each parameter's name from its module's (a tied one under both)
        return {f"{mn}.{pn}" if mn else pn for mn, m in model.named_modules() for pn, _ in m.named_parameters(recurse=False)}

    assert paired(pm) == paired(eager) and {n for n, _ in pm.named_parameters()} <= paired(pm)
    seen, want = [], []
    pm.apply(lambda m: seen.append(type(m).__name__.removeprefix("Distributed")))  # the model's modules, root too
    eager.apply(lambda m: want.append(type(m).__name__))
    assert seen[:-1] == want and seen[-1] == type(pm).__name__
    pm.eval()  # train() and eval() still reach the graph and the model
    assert not pm.training and not pm.module.training and not pm.graph_module.training
    pm.train()
    assert all(m.training for m in (pm, pm.module, pm.graph_module, pm.transformer.h[0]))


def test_the_state_dict_of_the_model_is_whole_and_loads_into_a_plain_model(gpt_pair):
    pm, eager, _ = gpt_pair
    state = pm.module.state_dict()
    assert list(state) == list(eager.state_dict())
    assert all(type(t) is torch.Tensor and torch.equal(t, eager.state_dict()[k]) for k, t in state.items())
    plain = GPT(GPTConfig())
    plain.load_state_dict(state)
    with torch.no_grad():
        for p in pm.parameters():
            p.add_(1.0)
    pm.module.load_state_dict(state)  # whole tensors into the shards
    assert all(torch.equal(t, state[k]) for k, t in pm.module.state_dict().items())


def test_evaluation_of_a_replicated_plan_runs_the_model_on_this_ranks_tensors(gpt_pair):
    """In eval mode under no_grad, a plan that replicates every tensor needs no other rank (rank 0
    alone may evaluate, as with DDP) and takes any shape: greedy or sampled decoding equals eager's."""
    pm, eager, batch = gpt_pair
    pm.eval()
    eager.eval()
    prompt = batch[0][:1, :5]  # another shape than the example inputs
    torch.manual_seed(3)
    got = pm.generate(prompt, 4)
    torch.manual_seed(3)
    want = eager.generate(prompt, 4)
    assert torch.equal(got, want)
    with torch.no_grad():
        assert torch.equal(pm(*batch)[1], eager(*batch)[1])
    assert pm._num_calls == 0  # none of these ran the compiled graph
    pm.train()
    pm(*batch)
    assert pm._num_calls == 1


def test_local_evaluation_runs_the_hooks_registered_before_compile(world_of_one):
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    model.transformer.ln_f.register_forward_hook(lambda module, args, out: out * 3.0)
    model.register_forward_hook(lambda module, args, out: (out[0] + 1.0, out[1]))
    eager = copy.deepcopy(model)
    batch = (torch.randint(0, 128, (4, 32)), torch.randint(0, 128, (4, 32)))
    pm = autopar.compile(model, (1,), example_inputs=batch, cluster="cpu")
    pm.eval()
    eager.eval()
    with torch.no_grad():  # a replicated plan's eval runs the model locally: its hooks too, once each
        assert pm._evaluates_locally(batch, {}, pm._mode())
        got, want = pm(*batch), eager(*batch)
    assert torch.allclose(got[0], want[0]) and torch.allclose(got[1], want[1])
    assert torch.allclose(pm(*batch)[1], eager(*batch)[1])  # the graph, hooks traced in


def test_ranks_in_different_calls_are_refused_with_the_fix():
    check_same_call(torch.tensor([[3.0, 1.0], [3.0, 1.0]]))
    with pytest.raises(PartialCallError) as info:
        check_same_call(torch.tensor([[4.0, 0.0], [3.0, 1.0]]))
    message = str(info.value)
    assert "rank 0: call 4 in eval mode; rank 1: call 3 in train mode" in message
    assert "every rank must call the compiled module" in message and "torch.no_grad()" in message


def _master_only_eval(pm, rows: tuple, mine: tuple) -> str:
    """nanoGPT's own ``estimate_loss()``: rank 0 alone evaluates ``rows`` in eval mode under
    ``no_grad``, then every rank trains on ``mine``; what it raised, and how long it took."""
    start = time.monotonic()
    try:
        if torch.distributed.get_rank() == 0:
            with torch.no_grad():
                pm.eval()(*rows)
        pm.train()(*mine)
    except PartialCallError as error:
        return f"{time.monotonic() - start:.0f}s {error}"
    return "ran"


def _ddp_habits(rank: int, world: int) -> tuple[list[float], str, str, str]:
    """(this rank's gradient sums with DDP's sync flag off, then on; what a forward that rank 0
    alone runs raised, and how long it took: under batch='per_rank' on its own rows, as nanoGPT's
    estimate_loss passes them, and under a sharded plan; and what a gather of the whole state that
    rank 0 alone runs under that plan raised)."""
    torch.manual_seed(0)
    rows = (torch.randint(0, 128, (4, 32)), torch.randint(0, 128, (4, 32)))
    pm = autopar.compile(GPT(GPTConfig()), (world,), example_inputs=rows, data=autopar.DataOptions(batch="per_rank"))
    mine = tuple(t[rank * 2 : rank * 2 + 2] for t in rows)
    sums = []
    for sync in (False, True):
        pm.require_backward_grad_sync = sync
        assert pm.require_backward_grad_sync is sync
        pm(*mine)[1].backward()
        sums.append(float(local_of(pm.transformer.h[0].c_fc.weight.grad).sum()))
    per_rank = _master_only_eval(pm, mine, mine)  # its rows: a rank's share of a global batch
    fsdp = autopar.hand_plan("fsdp", GPT(GPTConfig()), (world,), example_inputs=rows, cluster="cpu")
    sharded = autopar.compile(GPT(GPTConfig()), (world,), example_inputs=rows, plan=fsdp)
    evaluated = _master_only_eval(sharded, rows, rows)
    start = time.monotonic()
    try:
        if rank == 0:  # nanoGPT's checkpoint: raw_model.state_dict() on the master alone
            sharded.module.state_dict()
        sharded.train()(*rows)
        gathered = "ran"
    except PartialCallError as error:
        gathered = f"{time.monotonic() - start:.0f}s {error}"
    return sums, per_rank, evaluated, gathered


@pytest.mark.multiproc
def test_ddp_habits_on_two_ranks(rank_pool):
    """DDP's ``require_backward_grad_sync``, as nanoGPT sets it per micro-step: False keeps each
    rank's own gradient (they differ), the next backward with it True reduces both micro-steps
    (the ranks agree). A forward that rank 0 alone runs under a sharded plan fails at once on
    every rank, saying that every rank must call it, instead of waiting out the timeout; so does
    one under batch='per_rank' on the rank's own rows (nanoGPT's own estimate_loss), which mean a
    share of a global batch, and a gather of the whole state on rank 0 alone (nanoGPT's checkpoint)."""
    results = rank_pool(2).run(_ddp_habits, timeout_s=240)
    held, synced = [result[0][0] for result in results], [result[0][1] for result in results]
    assert held[0] != held[1]
    assert synced[0] == pytest.approx(synced[1], rel=1e-12)
    for _, per_rank, sharded, gathered in results:
        seconds, _, text = gathered.partition(" ")
        assert text.startswith("every rank must gather the whole state of a compiled module together"), gathered
        assert "rank 0: gathering the whole state after call 1; rank 1: call 2 in train mode" in text
        assert "Call it on every rank and let rank 0 alone write" in text and float(seconds.rstrip("s")) < 30
        for message, call in ((per_rank, 3), (sharded, 1)):
            seconds, _, text = message.partition(" ")
            assert text.startswith("every rank must call the compiled module"), message
            assert f"rank 0: call {call} in eval mode; rank 1: call {call} in train mode" in text
            assert "Run it on every rank" in text and "replicates every parameter" in text
            assert float(seconds.rstrip("s")) < 30


def test_save_pretrained_through_pm_writes_the_whole_model(world_of_one, tmp_path):
    """HF's ``save_pretrained`` is the model's method: through ``pm`` it saves the whole weights
    (``state_dict()`` of ``pm.module``), which ``from_pretrained`` loads into a plain model."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (2, 16))
    pm = autopar.compile(model, (1,), example_kwargs=dict(input_ids=ids, labels=ids), cluster="cpu")
    assert pm.config.hidden_size == 32 and pm.num_parameters() == model.num_parameters()
    pm.save_pretrained(tmp_path)
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    want = model.state_dict()
    assert all(torch.equal(tensor, want[name]) for name, tensor in back.state_dict().items())
