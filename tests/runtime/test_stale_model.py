"""The model passed to ``compile`` after ``pm`` has trained (``runtime.stale_model``): reading it
for the trained weights (its ``state_dict()``, an evaluation, a generation) is refused, where DDP
and FSDP2 would give the trained model; training it eagerly beside ``pm`` is left alone."""

from __future__ import annotations

import copy
import gc
import pickle

import pytest
import torch

import autopar
from autopar.errors import UsageError


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


@pytest.mark.parametrize("plan", [None, "fsdp"])  # plain parameters, and DTensors
@pytest.mark.parametrize("optimizer", ["fused", "foreach", "autopar"])
def test_reading_the_model_for_what_pm_trained_is_refused(world_of_one, plan, optimizer):
    model, pm = _compiled(plan)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    assert _evaluate(model) == _evaluate(pm)  # nothing trained yet: the same weights, nothing to refuse
    model.train(), pm.train()
    if optimizer == "autopar":
        opt = autopar.optim.AdamW(pm, lr=0.1)
    else:
        opt = torch.optim.AdamW(pm.parameters(), lr=0.1, **{optimizer: True})
    _train(pm, opt)
    with pytest.raises(UsageError, match=STALE):
        model.state_dict()
    with pytest.raises(UsageError, match=r"this forward \(an evaluation or generation\) would read the weights"):
        _evaluate(model)
    trained = pm.module.state_dict()
    assert not torch.equal(trained["up.weight"], initial["up.weight"])
    model.load_state_dict(trained)  # the fix the error names: the model is the trained one now
    torch.testing.assert_close(model.state_dict(), trained)
    torch.testing.assert_close(_evaluate(model), _evaluate(pm))


def test_a_model_trained_beside_pm_is_left_alone(world_of_one):
    model, pm = _compiled()
    opt_pm = torch.optim.AdamW(pm.parameters(), lr=0.1, fused=True)
    opt_eager = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    for _ in range(3):  # pm steps first: the model's first forward comes after, still at its initial weights
        _train(pm, opt_pm)
        _train(model, opt_eager)
    torch.testing.assert_close(_evaluate(model), _evaluate(pm))
    torch.testing.assert_close(model.state_dict(), pm.module.state_dict())
    assert not model._forward_pre_hooks and not model._state_dict_pre_hooks  # the guard is gone once it stepped


def test_an_optimizer_built_on_the_model_before_compile_trains_pm_and_the_model_is_refused(world_of_one):
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)  # DDP scripts build it before the wrap
    pm = autopar.compile(model, (1,), example_inputs=(X,), cluster="cpu")
    _train(pm, opt)  # re-bound to pm's parameters (runtime.originals)
    with pytest.raises(UsageError, match=STALE):
        torch.save(model.state_dict(), "unused.pt")


def test_a_loaded_checkpoint_changes_pm(world_of_one):
    model, pm = _compiled()
    pm.load_state_dict({k: v + 1 for k, v in pm.module.state_dict().items()})
    with pytest.raises(UsageError, match=STALE):
        model.state_dict()


def test_copies_compiles_and_a_gone_pm_pass(world_of_one, caplog):
    model, pm = _compiled()
    _train(pm, torch.optim.AdamW(pm.parameters(), lr=0.1, fused=True))
    copied = copy.deepcopy(model)  # a reference of the initial weights, kept on purpose
    assert _evaluate(copied) == _evaluate(pickle.loads(pickle.dumps(model)))
    model.train()
    again = autopar.compile(model, (1,), example_inputs=(X,), cluster="cpu")  # compiles the model as it is
    assert again(X) == copied.train()(X)
    assert "forward hooks" not in caplog.text  # the guard is not the model's own hook (trace.hooks)
    with pytest.raises(UsageError, match=STALE):
        model.state_dict()  # by the first pm
    del pm
    gc.collect()  # its reference cycles
    again.load_state_dict({k: v + 1 for k, v in again.module.state_dict().items()})
    with pytest.raises(UsageError, match=STALE):
        model.state_dict()  # by the second
    del again
    gc.collect()
    model.state_dict()  # no compiled module left to be behind: the model is the user's again
    assert not model._forward_pre_hooks and not model._state_dict_pre_hooks


class Dropped(Net):
    def __init__(self):
        super().__init__()
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x):
        return self.down(self.drop(torch.relu(self.up(x)))).pow(2).mean()


def test_switching_the_models_mode_for_pm_is_refused(world_of_one):
    model = Dropped()
    pm = autopar.compile(model, (1,), example_inputs=(X,), cluster="cpu")
    model.eval()  # before pm trained: the model is still pm's equal, nothing to say yet
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


def _wrapped_under_another_name(rank: int, world: int) -> dict[str, tuple[float, list[float], list[float]]]:
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
        out[kind] = (max((full[k] - v).abs().max().item() for k, v in eager.state_dict().items()), norms, eager_norms)
    return out


@pytest.mark.multiproc
def test_loading_clipping_zeroing_and_freezing_through_the_model_act_on_pm(rank_pool):
    """The model's own parameters stand for pm's (``runtime.originals``): before, the clip measured
    0.0 and scaled nothing, ``model.zero_grad()`` zeroed nothing (pm's gradients summed over steps),
    freezing the model's first layer froze nothing (2.9e-3 to 2.4e-2 off eager) and a checkpoint
    loaded into the model after the wrap was not trained from (0.49 off)."""
    for result in rank_pool(2).run(_wrapped_under_another_name, timeout_s=300):
        for kind, (worst, norms, eager_norms) in result.items():
            assert worst < 1e-12, f"{kind}: parameters off eager's by {worst:.1e}"
            assert norms == pytest.approx(eager_norms, rel=1e-12), kind


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
