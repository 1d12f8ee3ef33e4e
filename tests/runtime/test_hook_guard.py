"""Module hooks registered after compile are refused with the fix (``runtime.hook_guard``);
hooks registered before compile keep their traced behaviour."""

from __future__ import annotations

import copy

import pytest
import torch

import autopar
from autopar.errors import HookError, UsageError
from autopar.runtime.hook_guard import HookGuard
from autopar.zoo.models import build_model, example_batch

REGISTER = {
    "forward": lambda m: m.register_forward_hook(lambda mod, args, out: out * 2),
    "forward_pre": lambda m: m.register_forward_pre_hook(lambda mod, args: (args[0] * 2,)),
    "backward": lambda m: m.register_full_backward_hook(lambda mod, gin, gout: gin),
    "backward_pre": lambda m: m.register_full_backward_pre_hook(lambda mod, gout: gout),
    "forward_kwargs": lambda m: m.register_forward_hook(lambda mod, args, kwargs, out: out, with_kwargs=True),
}
GLOBAL = {
    "forward": lambda: torch.nn.modules.module.register_module_forward_hook(lambda mod, args, out: None),
    "forward_pre": lambda: torch.nn.modules.module.register_module_forward_pre_hook(lambda mod, args: None),
    "backward": lambda: torch.nn.modules.module.register_module_full_backward_hook(lambda mod, gin, gout: None),
}


@pytest.fixture(scope="module")
def compiled(world_of_one):
    torch.manual_seed(0)
    model = build_model("gpt")
    batch = example_batch("gpt", 2)
    return autopar.compile(model, mesh=(1,), example_inputs=batch), batch


@pytest.mark.parametrize("kind", list(REGISTER))
def test_a_submodule_hook_added_after_compile_is_refused(compiled, kind):
    pm, batch = compiled
    ln_f = pm.module.get_submodule("transformer.ln_f")
    with pytest.raises(HookError, match=r"transformer.ln_f.*before autopar.compile"):
        REGISTER[kind](ln_f)
    assert not ln_f._forward_hooks and not ln_f._forward_pre_hooks and not ln_f._backward_hooks
    pm(*batch).backward()  # the module still runs


@pytest.mark.parametrize("kind", list(GLOBAL))
def test_a_global_hook_added_after_compile_refuses_the_next_call(compiled, kind):
    pm, batch = compiled
    handle = GLOBAL[kind]()
    try:
        with pytest.raises(HookError, match=r"global module hook.*before autopar.compile"):
            pm(*batch)
    finally:
        handle.remove()
    pm(*batch)  # removed again: the call runs


def test_a_hook_on_the_compiled_module_itself_runs(compiled):
    pm, batch = compiled
    seen = []
    handle = pm.register_forward_hook(lambda mod, args, out: seen.append(out.detach()))
    try:
        loss = pm(*batch)
    finally:
        handle.remove()
    assert len(seen) == 1 and torch.equal(seen[0], loss.detach())


def test_a_copy_of_the_compiled_module_takes_hooks(compiled):
    pm, _ = compiled
    holder = copy.deepcopy(pm.module)
    handle = holder.get_submodule("transformer.ln_f").register_forward_hook(lambda mod, args, out: None)
    handle.remove()


@pytest.mark.parametrize(
    "change",
    [
        lambda view: setattr(view.transformer, "ln_f", torch.nn.Identity()),  # a module the graph runs, replaced
        lambda view: view.transformer.h.__setitem__(0, torch.nn.Identity()),  # a layer of a ModuleList
        lambda view: delattr(view.transformer, "ln_f"),
        lambda view: setattr(view.transformer, "ln_f", None),
        lambda view: view.transformer.h.pop(1),
    ],
    ids=["replace", "replace-layer", "delete", "none", "pop"],
)
def test_a_submodule_replaced_or_removed_after_compile_is_refused(compiled, change):
    """The graph runs the modules traced at compile: a new one (PEFT's wrappers, resized
    embeddings, another head) would never run, where eager would run it."""
    pm, batch = compiled
    want = pm(*batch).item()
    with pytest.raises(UsageError, match=r"module 'transformer\.(ln_f|h\.[01])' of a compiled module was (replaced|removed)"):
        change(pm.module)
    assert pm(*batch).item() == want, "the refused change left the module as it was"


def test_a_new_submodule_may_be_added_and_a_copy_takes_changes(compiled):
    pm, batch = compiled
    pm.module.probe = torch.nn.Linear(2, 2)  # the forward never calls it: the user's own code does
    pm.module.probe = pm.module.probe  # the same module again changes nothing
    assert isinstance(pm(*batch), torch.Tensor)
    del pm.module.probe  # added after compile: no graph ran it
    holder = copy.deepcopy(pm.module)
    holder.transformer.ln_f = torch.nn.Identity()  # a copy is a plain module: the guard belongs to pm


def test_a_parameter_or_buffer_the_graph_cannot_read_is_refused_at_the_assignment(compiled):
    """The graph reads each parameter and buffer at every call: a tensor of another shape or dtype
    in its place, or none (a parametrization moves it), is refused; one it reads alike is used."""
    pm, batch = compiled
    block = pm.module.transformer.h[0]
    with pytest.raises(UsageError, match=r"parameter 'transformer\.h\.0\.attn\.q_proj\.weight' .* was removed .*weight_norm"):
        torch.nn.utils.parametrizations.weight_norm(block.attn.q_proj)
    with pytest.raises(UsageError, match=r"replaced by a tensor of shape \(3,\).*load_state_dict\(\{'transformer\.ln_f\.bias'"):
        pm.module.transformer.ln_f.bias = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(UsageError, match=r"parameter 'transformer\.ln_f\.bias' .* was removed"):
        del pm.module.transformer.ln_f.bias
    held = pm.module.transformer.ln_f.bias
    want = pm(*batch).item()
    try:
        pm.module.transformer.ln_f.bias = torch.nn.Parameter(held.detach() + 1)  # read alike: used, as in eager
        assert pm(*batch).item() != want
    finally:
        pm.module.transformer.ln_f.bias = held
    assert pm(*batch).item() == want


def _replaced_shard(rank: int, world: int) -> dict[str, str]:
    """What replacing a DTensor parameter, or its ``.data``, after compile says (on an FSDP plan)."""
    torch.manual_seed(0)
    model = Scaled()
    x = torch.randn(4, 8)
    plan = autopar.hand_plan("fsdp", model, (world,), example_inputs=(x,), cluster="cpu")
    pm = autopar.compile(model, (world,), example_inputs=(x,), plan=plan)
    averaged = torch.optim.swa_utils.AveragedModel(pm)  # a deep copy: its parameters are its own
    said = {"copy": type(averaged(x)).__name__}
    weight = pm.module.fc.weight
    for change, new in {
        "whole": lambda: torch.nn.Parameter(torch.zeros(8, 8)),  # whole, where the plan holds a shard
        "same_layout": lambda: torch.nn.Parameter(weight.detach() * 2),  # the graph would read the old one
    }.items():
        try:
            pm.module.fc.weight = new()
            said[change] = "assigned"
        except UsageError as error:
            said[change] = str(error)
    # SAM's restore: torch ignores .data assignment on a DTensor, so the step would go on from the
    # perturbed weights (0.075 off eager); the step refuses it, and the in-place copy it names is right
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    pm(x).backward()
    saved = weight.data.clone()
    with torch.no_grad():
        weight.add_(1.0)
    weight.data = saved
    try:
        opt.step()
        said["data"] = "stepped"
    except UsageError as error:
        said["data"] = str(error)
    try:  # and a call with no step between (an average swapped in for evaluation)
        with torch.no_grad():
            pm(x)
        said["data_call"] = "called"
    except UsageError as error:
        said["data_call"] = str(error)
    try:  # nor would a save hand out the values torch ignored
        pm.full_state_dict()
        said["data_save"] = "saved"
    except UsageError as error:
        said["data_save"] = str(error)
    return said


@pytest.mark.multiproc
def test_a_shard_replaced_after_compile_is_refused_naming_the_fix(rank_pool):
    for said in rank_pool(2).run(_replaced_shard, timeout_s=240):
        whole, same, data = said["whole"], said["same_layout"], said["data"]
        assert "parameter 'fc.weight' of a compiled module was replaced by a tensor of shape (8, 8)" in whole, whole
        assert "where the graph reads a DTensor (Shard(dim=0),) of global shape (8, 8)" in whole, whole
        assert "pm.load_state_dict({'fc.weight': tensor}, strict=False)" in whole, whole
        assert "replaced by a DTensor (Shard(dim=0),) of global shape (8, 8)" in same, same
        assert "parameter 'fc.weight' of a compiled module had its .data replaced" in data, data
        assert "p.data.copy_(value)" in data, data
        assert said["data_call"].startswith("parameter 'fc.weight' of a compiled module had its .data replaced")
        assert said["data_save"] == said["data_call"]
        assert said["copy"] == "Tensor", said["copy"]


class Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.out(self.fc(x)).square().mean()


def test_a_hook_registered_before_compile_is_traced(world_of_one):
    torch.manual_seed(0)
    model = Scaled().double()
    handle = model.fc.register_forward_hook(lambda mod, args, out: out * 3)
    eager = copy.deepcopy(model)
    x = torch.randn(4, 8, dtype=torch.float64)
    pm = autopar.compile(model, mesh=(1,), example_inputs=(x,))
    loss, want = pm(x), eager(x)
    loss.backward(), want.backward()
    torch.testing.assert_close(loss.detach(), want.detach())
    grads = pm.full_grads()
    for name, p in eager.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)
    handle.remove()


def test_a_loss_on_an_activation_a_hook_stored_while_tracing_is_refused_at_backward(world_of_one):
    """A hook that stores an activation for an auxiliary loss ran only while tracing: the stored
    tensor is a tracing placeholder, whose backward wrote gradients from no data, without a word."""
    torch.manual_seed(0)
    model = Scaled().double()
    store = {}
    handle = model.fc.register_forward_hook(lambda mod, args, out: store.__setitem__("activation", out))
    x = torch.randn(4, 8, dtype=torch.float64)
    pm = autopar.compile(model, mesh=(1,), example_inputs=(x,))
    loss = pm(x) + 0.1 * store["activation"].pow(2).mean()
    with pytest.raises(UsageError, match="tracing placeholder.*forward hook that stores an activation"):
        loss.backward()
    pm(x).backward()  # the model's own loss trains as before
    assert all(p.grad is not None for p in pm.parameters())
    handle.remove()


def test_a_guarded_hook_stays_and_cannot_be_removed():
    model = Scaled()
    handle = model.fc.register_forward_hook(lambda mod, args, out: out * 3)
    guard = HookGuard.install(model)
    with pytest.raises(HookError, match="removed from module 'fc'.*before autopar.compile"):
        model.fc._forward_hooks.pop(handle.id)
    guard.check()
    handle.remove()  # through the table it was registered in: found at the next check
    with pytest.raises(HookError, match="hook of module 'fc' was removed after autopar.compile.*compile again"):
        guard.check()
    assert len(model.fc._forward_hooks) == 1
    torch.testing.assert_close(model(torch.ones(2, 8)), Scaled.forward(model, torch.ones(2, 8)))


def test_the_guard_compares_the_global_tables_when_one_held_a_hook_at_install():
    """The check's fast path (no global hook at install and none now) must not hide a change
    where one was there: adding another, or removing it, is refused; the same tables pass."""
    there = GLOBAL["forward"]()
    try:
        guard = HookGuard.install(torch.nn.Linear(2, 2))
        guard.check()  # the tables as at install
        added = GLOBAL["forward_pre"]()
        with pytest.raises(HookError, match=r"register_module_forward_pre_hook"):
            guard.check()
        added.remove()
        guard.check()
    finally:
        there.remove()
    with pytest.raises(HookError, match=r"register_module_forward_hook"):
        guard.check()  # every table empty now, but one held a hook at install
