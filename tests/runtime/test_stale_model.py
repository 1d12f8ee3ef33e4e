"""The model passed to ``compile`` after ``pm`` has trained (``runtime.stale_model``): where ``pm``
holds its tensors whole it is the trained model, as under DDP; where the plan cuts them, reading it
for the trained weights (its ``state_dict()``, an evaluation, a generation) is refused; training it
eagerly beside ``pm`` gives it weights of its own."""

from __future__ import annotations

import copy
import gc
import pickle

import pytest
import torch
from torch.distributed.tensor import Replicate

import autopar
from autopar.errors import UsageError
from autopar.zoo import build_model, example_batch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))).pow(2).mean()


X = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
STALE = r"^the Net passed to autopar\.compile is not the model that trains.*pm\.module\.state_dict\(\)"


def _compiled(plan: str | None = None):
    model = Net()
    hand = None if plan is None else autopar.hand_plan(plan, model, (1,), example_inputs=(X,), cluster="cpu")
    return model, autopar.compile(model, (1,), example_inputs=(X,), cluster="cpu", plan=hand)


def _train(pm, opt, steps: int = 1) -> None:
    for _ in range(steps):
        pm(X).backward()
        opt.step()
        opt.zero_grad()


def _evaluate(model):
    model.eval()
    with torch.no_grad():
        return model(X)


def _local(pm, name: str) -> torch.Tensor:
    return pm.local_shard(name)


@pytest.mark.parametrize("plan", [None, "fsdp"])  # plain parameters, and DTensors (whole on one device)
@pytest.mark.parametrize("optimizer", ["fused", "foreach", "autopar"])
def test_the_model_is_the_trained_one_where_pm_holds_its_tensors_whole(world_of_one, plan, optimizer):
    """As under DDP: pm holds the model's own tensors where the plan keeps them whole, so the name
    the script wrapped is the trained model (its state_dict, an evaluation, an EMA of it), and the
    weights are on the device once."""
    model, pm = _compiled(plan)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    assert all(t.data_ptr() == _local(pm, k).data_ptr() for k, t in model.state_dict().items())
    ema = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.5))
    reference = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.5))
    model.train(), pm.train()
    if optimizer == "autopar":
        opt = autopar.optim.AdamW(pm, lr=0.1)
    else:
        opt = torch.optim.AdamW(pm.parameters(), lr=0.1, **{optimizer: True})
    for _ in range(3):
        _train(pm, opt)
        ema.update_parameters(model)  # the pre-wrap name, as a DDP script keeps it
        reference.update_parameters(pm.module)
    trained = pm.module.state_dict()
    assert not torch.equal(trained["up.weight"], initial["up.weight"])
    torch.testing.assert_close(model.state_dict(), trained, rtol=0, atol=0)
    torch.testing.assert_close(ema.state_dict(), reference.state_dict(), rtol=0, atol=0)
    torch.testing.assert_close(_evaluate(model), _evaluate(pm))


def test_a_model_trained_beside_pm_trains_apart(world_of_one, caplog):
    model, pm = _compiled()
    reference, alone = Net(), Net()
    pm_alone = autopar.compile(alone, (1,), example_inputs=(X,), cluster="cpu")
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1, fused=True) for m in (pm, model, reference, pm_alone)]
    for _ in range(3):  # the model's first forward before pm's first step: both start from the same weights
        for module, opt in zip((model, pm, reference, pm_alone), (opts[1], opts[0], opts[2], opts[3])):
            _train(module, opt)
    assert "trains itself now" not in caplog.text
    assert model.up.weight.data_ptr() != _local(pm, "up.weight").data_ptr()  # each trains its own
    torch.testing.assert_close(model.state_dict(), reference.state_dict())
    torch.testing.assert_close(pm.module.state_dict(), pm_alone.module.state_dict(), rtol=0, atol=0)
    torch.testing.assert_close(_evaluate(model), _evaluate(pm))
    assert not model._forward_pre_hooks and not model._state_dict_pre_hooks  # the guard is gone once it stepped
    again = autopar.compile(model, (1,), example_inputs=(X,), cluster="cpu")  # a model that trains itself
    assert model.up.weight.data_ptr() != _local(again, "up.weight").data_ptr()  # keeps weights of its own


def test_a_model_that_trains_itself_after_pm_goes_on_from_the_trained_weights_and_says_so(world_of_one, caplog):
    model, pm = _compiled()
    opt_pm = torch.optim.AdamW(pm.parameters(), lr=0.1, fused=True)
    _train(pm, opt_pm)
    trained = pm.module.state_dict()
    model(X)  # its own forward in training: from here on it trains apart, from pm's weights as they are
    assert "trains itself now" in caplog.text and "copy.deepcopy(model)" in caplog.text
    torch.testing.assert_close(model.state_dict(), trained, rtol=0, atol=0)
    _train(model, torch.optim.SGD(model.parameters(), lr=1.0))
    torch.testing.assert_close(pm.module.state_dict(), trained, rtol=0, atol=0)  # pm did not move with it


def test_an_optimizer_built_on_the_model_before_compile_trains_pm_and_so_the_model(world_of_one):
    model = Net()
    initial = copy.deepcopy(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)  # DDP scripts build it before the wrap
    pm = autopar.compile(model, (1,), example_inputs=(X,), cluster="cpu")
    _train(pm, opt)  # re-bound to pm's parameters (runtime.originals)
    assert opt.param_groups[0]["params"][0] is pm.module.up.weight
    assert not torch.equal(model.up.weight, initial["up.weight"])
    torch.testing.assert_close(model.state_dict(), pm.module.state_dict(), rtol=0, atol=0)


def test_a_checkpoint_loaded_into_pm_is_the_models(world_of_one):
    model, pm = _compiled()
    pm.load_state_dict({k: v + 1 for k, v in pm.module.state_dict().items()})
    torch.testing.assert_close(model.state_dict(), pm.module.state_dict(), rtol=0, atol=0)


def test_a_second_compile_copies_and_a_gone_pm_passes(world_of_one, caplog):
    model, pm = _compiled()
    _train(pm, torch.optim.AdamW(pm.parameters(), lr=0.1, fused=True))
    copied = copy.deepcopy(model)  # the trained weights
    assert _evaluate(copied) == _evaluate(pickle.loads(pickle.dumps(model)))
    model.train()
    again = autopar.compile(model, (1,), example_inputs=(X,), cluster="cpu")  # compiles the model as it is
    assert again(X) == copied.train()(X)
    assert model.up.weight.data_ptr() == _local(pm, "up.weight").data_ptr() != _local(again, "up.weight").data_ptr()
    assert "forward hooks" not in caplog.text  # the guard is not the model's own hook (trace.hooks)
    model.state_dict()  # the first pm's weights, as they are
    again.load_state_dict({k: v + 1 for k, v in again.module.state_dict().items()})
    with pytest.raises(UsageError, match=STALE):
        model.state_dict()  # the second pm holds weights of its own, changed since
    del pm, again
    gc.collect()  # their reference cycles
    model.state_dict()  # no compiled module left to be behind: the model is the user's again
    assert not model._forward_pre_hooks and not model._state_dict_pre_hooks


def test_a_load_into_pm_marks_the_models_cast_values_stale(world_of_one):
    """Under ``bf16-true`` pm holds bf16 copies on one device: the model's float32 values are its
    own, stale once pm changes; a load into pm (not only an optimizer step) makes reading them raise."""
    model = Net()
    ema = torch.optim.swa_utils.AveragedModel(model)
    pm = autopar.compile(model, (1,), example_inputs=(X,), cluster="cpu", precision="bf16-true")
    ema.update_parameters(model)  # nothing changed yet
    pm.load_state_dict({k: v + 1 for k, v in pm.module.state_dict().items()})
    with pytest.raises(UsageError, match=r"was read \(detach\) after the compiled module trained past it"):
        ema.update_parameters(model)
    model.load_state_dict(pm.module.state_dict())  # the fix the error names: the model holds pm's now
    ema.update_parameters(model)


def test_a_model_kept_beside_pm_that_holds_what_pm_does_not_is_named_at_the_first_call(world_of_one, caplog, monkeypatch):
    """On a GPU the whole tensors a kept model holds beside pm's own shards or casts are memory no
    plan counts: the first call says how much, and how to free it (a CPU stands in for the device)."""
    monkeypatch.setattr("autopar.runtime.stale_model._accelerator", lambda device: True)
    kept = Net()
    pm = autopar.compile(kept, (1,), example_inputs=(X,), cluster="cpu", precision="bf16-true")  # pm's: bf16 copies
    assert "still holds" not in caplog.text
    pm(X), pm(X)
    nbytes = sum(p.numel() * 4 for p in kept.parameters())
    assert caplog.text.count("still holds") == 1 and f"{nbytes / 2**20:.1f} MiB on cpu" in caplog.text
    assert "del model" in caplog.text and "model.cpu()" in caplog.text
    caplog.clear()
    shared = Net()
    autopar.compile(shared, (1,), example_inputs=(X,), cluster="cpu")(X)  # pm holds the model's own tensors
    autopar.compile(Net(), (1,), example_inputs=(X,), cluster="cpu", precision="bf16-true")(X)  # none kept
    assert "still holds" not in caplog.text


class Dropped(Net):
    def __init__(self):
        super().__init__()
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x):
        return self.down(self.drop(torch.relu(self.up(x)))).pow(2).mean()


def test_switching_the_models_mode_for_pm_is_refused(world_of_one):
    model = Dropped()
    pm = autopar.compile(model, (1,), example_inputs=(X,), cluster="cpu")
    model.eval()  # before pm trained too: pm holds the model's own tensors, so the model stands for pm
    with pytest.raises(UsageError, match=r"switched to another mode after compile \(model\.eval\(\)\)"):
        pm(X)
    model.train()
    _train(pm, torch.optim.AdamW(pm.parameters(), lr=0.1, fused=True))
    model.eval()  # DDP's pre-wrap name: under DDP this switches the wrapped forward
    with pytest.raises(UsageError, match=r"switched to another mode after compile \(model\.eval\(\)\).*pm\.eval\(\)"):
        pm(X)
    model.train()
    model.drop.eval()
    with pytest.raises(UsageError, match=r"\(model\.drop\.eval\(\)\)"):
        pm(X)
    pm.module.drop.eval()  # pm switched alike: it runs so
    torch.testing.assert_close(pm(X), pm(X))  # no dropout: the same value twice


def test_a_model_compiled_twice_and_trained_beside_both_is_left_alone(world_of_one):
    model = Net()
    first, second = (autopar.compile(model, (1,), example_inputs=(X,), cluster="cpu") for _ in range(2))
    for pm in (first, second):
        _train(pm, torch.optim.AdamW(pm.parameters(), lr=0.1, fused=True))
    _train(model, torch.optim.AdamW(model.parameters(), lr=0.1, fused=True))  # fused: no version bumps
    assert torch.isfinite(_evaluate(model)) and model.state_dict()  # each watch saw the model's own step


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 2)).double()


def _through_the_model(model, trained, steps: int = 4) -> list[float]:
    """A DDP script that wrapped ``model`` under another name (``trained``) and resumes, clips,
    zeroes and freezes through ``model`` itself, as DDP lets it (the parameters are the same
    there): the clipped norms it measured."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    resumed = _mlp(seed=5)
    model.load_state_dict(resumed.state_dict())
    opt = torch.optim.SGD(trained.parameters(), lr=0.1)
    norms = []
    for step in range(steps):
        if step == 1:
            model[2].load_state_dict(resumed[2].state_dict())  # a module of it, mid-run
        if step == 2:
            model[0].requires_grad_(False)
        trained(x).pow(2).mean().backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        opt.step()
        model.zero_grad()
    return norms


def _wrapped_under_another_name(rank: int, world: int) -> dict[str, tuple]:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    eager = _mlp()
    eager_norms = _through_the_model(eager, eager)
    out = {}
    for kind in ("ddp", "fsdp", "megatron"):
        model = _mlp()
        plan = autopar.hand_plan(kind, model, (world,), example_inputs=(x,), cluster="cpu")
        ddp_model = autopar.compile(model, (world,), example_inputs=(x,), cluster="cpu", plan=plan)
        norms = _through_the_model(model, ddp_model)
        full = ddp_model.full_state_dict()
        try:  # the pre-wrap name read after training: the trained weights, or refused where the plan cuts them
            read = "equal" if all(torch.equal(full[k], v) for k, v in model.state_dict().items()) else "stale"
        except UsageError as error:
            read = "refused" if "is not the model that trains" in str(error) else str(error)
        worst = max((full[k] - v).abs().max().item() for k, v in eager.state_dict().items())
        whole = all(isinstance(p, Replicate) for spec in plan.params.values() for p in spec)
        out[kind] = (worst, norms, eager_norms, read, whole)
    return out | {"partly whole": _partly_whole(world)}


def _partly_whole(world: int) -> tuple[int, str]:
    """A plan that cuts some tensors and keeps others whole (megatron: the norms whole): how many the
    model shares with pm, and its state_dict read after a step."""
    model, batch = build_model("gpt"), example_batch("gpt", batch_size=4)
    plan = autopar.hand_plan("megatron", model, (world,), example_inputs=batch, cluster="cpu")
    pm = autopar.compile(model, (world,), example_inputs=batch, cluster="cpu", plan=plan)
    shared = sum(t.data_ptr() == pm.local_shard(k).data_ptr() for k, t in model.state_dict().items())
    opt = torch.optim.AdamW(pm.parameters(), lr=0.1, fused=True)
    pm(*batch).backward()
    opt.step()
    try:
        model.state_dict()
    except UsageError as error:
        return shared, "refused" if "is not the model that trains" in str(error) else str(error)
    return shared, "read"


@pytest.mark.multiproc
def test_loading_clipping_zeroing_and_freezing_through_the_model_act_on_pm(rank_pool):
    """The model's own parameters stand for pm's (``runtime.originals``): before, the clip measured
    0.0 and scaled nothing, ``model.zero_grad()`` zeroed nothing (pm's gradients summed over steps),
    freezing the model's first layer froze nothing (2.9e-3 to 2.4e-2 off eager) and a checkpoint
    loaded into the model after the wrap was not trained from (0.49 off)."""
    for result in rank_pool(2).run(_wrapped_under_another_name, timeout_s=300):
        shared, read = result.pop("partly whole")
        assert shared > 0 and read == "refused"  # what it shares is current, the rest is not: refused
        for kind, (worst, norms, eager_norms, read, whole) in result.items():
            assert worst < 1e-12, f"{kind}: parameters off eager's by {worst:.1e}"
            assert norms == pytest.approx(eager_norms, rel=1e-12), kind
            # a plan that holds every tensor whole (ddp) shares them: the model is the trained one;
            # one that cuts them (fsdp) refuses the read (it was stale after the mid-run load, before)
            assert read == ("equal" if whole else "refused"), kind
        assert [whole for *_, whole in result.values()][:2] == [True, False]  # ddp, fsdp


def _reads_after_training(rank: int, world: int) -> list[tuple[str, str]]:
    """What reads of the model's values do once pm trained its own shards (fsdp on 2 ranks)."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    model = _mlp()
    ema = torch.optim.swa_utils.AveragedModel(model)
    plan = autopar.hand_plan("fsdp", model, (world,), example_inputs=(x,), cluster="cpu")
    pm = autopar.compile(model, (world,), example_inputs=(x,), cluster="cpu", plan=plan)
    opt = torch.optim.AdamW(pm.parameters(), lr=0.1)

    def step():
        pm(x).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the model's gradients are pm's
        opt.step()
        model.zero_grad()

    reads = {
        "ema": lambda: ema.update_parameters(model),
        "data": lambda: model[0].weight.data.sum(),
        "copy": lambda: copy.deepcopy(model),
        "compile": lambda: autopar.compile(model, (world,), example_inputs=(x,), cluster="cpu", plan=plan),
        "metadata": lambda: (sum(p.numel() for p in model.parameters()), repr(model[0].weight), model.cpu()),
        "plan": lambda: autopar.plan(model, (world,), example_inputs=(x,), cluster="cpu"),  # shapes, not values
    }
    out = [("ema before", _outcome(reads["ema"]))]
    step()
    out += [(name, _outcome(read)) for name, read in reads.items()]
    model.load_state_dict(pm.module.state_dict())  # the fix the error names
    out.append(("ema after a load", _outcome(reads["ema"])))
    step()
    model(x).pow(2).mean().backward()  # the model trains itself from here: its values are its own
    out.append(("ema of a model trained beside", _outcome(reads["ema"])))
    return out


def _outcome(read) -> str:
    try:
        read()
    except UsageError as error:
        return "refused" if "after the compiled module trained past it" in str(error) else str(error)
    return "read"


@pytest.mark.multiproc
def test_reading_the_models_values_that_pm_trained_past_is_refused(rank_pool):
    """An EMA of the pre-wrap name (``AveragedModel.update_parameters(model)``), ``p.data``, a copy or
    another compile of it read the initial weights without a word where the plan cuts them; now they
    raise, while its metadata, gradients, moving it, a load into it and training it beside pass."""
    for result in rank_pool(2).run(_reads_after_training, timeout_s=300):
        assert dict(result) == {
            "ema before": "read",
            "ema": "refused",
            "data": "refused",
            "copy": "refused",
            "compile": "refused",
            "metadata": "read",
            "plan": "read",
            "ema after a load": "read",
            "ema of a model trained beside": "read",
        }


def test_a_model_trained_beside_pm_keeps_its_own_gradients(world_of_one):
    model, pm = _compiled("fsdp")
    pm(X).backward()
    assert model.up.weight.grad is pm.module.up.weight.grad  # pm's, while the model has none of its own
    assert isinstance(model.up.weight, torch.nn.Parameter) and repr(model.up.weight).startswith("Parameter containing:")
    pm.zero_grad()
    model(X).backward()  # the model's own forward, in training: it trains beside pm from now on
    assert model.up.weight.grad is not pm.module.up.weight.grad and pm.module.up.weight.grad is None
    pm(X).backward()
    model.zero_grad()  # its own gradients, not pm's; then none of its own, and still not pm's
    assert model.up.weight.grad is None and pm.module.up.weight.grad is not None
    model.up.requires_grad_(False)
    assert pm.module.up.weight.requires_grad
    copied = copy.deepcopy(model)
    assert copied.up.weight.grad is None and pickle.loads(pickle.dumps(model)).up.weight.grad is None
