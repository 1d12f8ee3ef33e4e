"""Gradients that go around autograd's usual path, against eager on 2 gloo ranks in float64:
``backward(inputs=...)`` and ``torch.autograd.grad`` over a compiled module's parameters
(``runtime.autograd_calls``), post-accumulate-grad hooks and torch's optimizer in backward, and
losses a DDP script takes from each rank's own rows of the outputs (``batch="per_rank"``).

A GAN's discriminator step (``d_loss.backward(inputs=list(D.parameters()))``) computed no gradient
at all under a plan that shards parameters, and ``torch.autograd.grad(..., allow_unused=True)``
returned None for each of them; where a bucket node holds several parameters, naming one made
every other's gradient land in ``.grad`` too. Each check below failed before.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

import autopar
from autopar.errors import HookError, UsageError
from autopar.zoo.models import build_model, example_batch

PLANS = ("ddp", "fsdp", "megatron")
TOL = 1e-12


class _MLP(torch.nn.Module):
    """Small enough that the solver's plan on 2 CPU ranks shards it and reduces in the graph, with
    no bucket: ``torch.autograd.grad`` over its DTensor parameters is answered."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(64, 256), torch.nn.Linear(256, 256), torch.nn.Linear(256, 4)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _whole(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _refused(register) -> str:
    """What ``register`` (a parameter's ``register_hook``) raised for a gradient-halving hook."""
    try:
        register(lambda grad: grad * 0.5)
    except HookError as error:
        return str(error)
    return ""


def _off(got: torch.Tensor | None, want: torch.Tensor) -> float:
    return float("inf") if got is None else (got - want).abs().max().item()


def _partial_backward(pm, eager, batch) -> dict[str, object]:
    """``backward(inputs=)`` naming one block's parameters: the named ones' gradients, and the names
    of parameters that got a gradient eager did not give them."""
    named = [name for name, _ in eager.named_parameters() if ".h.1." in name]
    mine, theirs = dict(pm.named_parameters()), dict(eager.named_parameters())
    pm(*batch).backward(inputs=[mine[name] for name in named])
    eager(*batch).backward(inputs=[theirs[name] for name in named])
    grads = pm.full_grads()
    return {
        "named": len(named),
        "worst": max(_off(grads.get(name), theirs[name].grad) for name in named),
        "extra": sorted(name for name, p in theirs.items() if p.grad is None and grads.get(name) is not None),
    }


def _under(kind: str, model: torch.nn.Module, world: int, batch: tuple) -> torch.nn.Module:
    """``model`` (the zoo's GPT) compiled under hand plan ``kind`` on ``world`` CPU ranks."""
    plan = autopar.hand_plan(kind, model, (world,), example_inputs=batch, cluster="cpu")
    return autopar.compile(model, (world,), example_inputs=batch, cluster="cpu", plan=plan)


def _grad_calls(rank: int, world: int) -> dict[str, object]:
    batch = example_batch("gpt", 8)
    said: dict[str, object] = {}
    for kind in PLANS:
        model, eager = build_model("gpt").double(), build_model("gpt").double()
        pm = _under(kind, model, world, batch)
        said[kind] = _partial_backward(pm, eager, batch)
        # (a DTensor parameter's is refused at the next call: test_hook_guard)
        plain = [p for p in pm.parameters() if not isinstance(p, DTensor)][:1]
        said[kind]["hooks"] = [_refused(p.register_hook) for p in (*plain, next(model.parameters()))]
        for module in (pm, eager):
            module.zero_grad()
        try:  # every plan of the GPT reduces its gradients in buckets
            torch.autograd.grad(pm(*batch), list(pm.parameters()), allow_unused=True)
            said[kind]["refused"] = ""
        except UsageError as error:
            said[kind]["refused"] = str(error)
        said[kind]["untouched"] = all(p.grad is None for p in pm.parameters())
        pm(*batch).backward()  # and the next whole backward is eager's
        eager(*batch).backward()
        grads = pm.full_grads()
        said[kind]["after"] = max(_off(grads.get(name), p.grad) for name, p in eager.named_parameters())

    generator = torch.Generator().manual_seed(5)
    x, y = (
        torch.randn(8, 64, generator=generator, dtype=torch.float64),
        torch.randn(8, 4, generator=generator, dtype=torch.float64),
    )
    torch.manual_seed(0)
    model = _MLP().double()
    torch.manual_seed(0)
    eager = _MLP().double()
    pm = autopar.compile(model, (world,), example_inputs=(x,), cluster="cpu")
    mine = torch.autograd.grad(F.mse_loss(pm(x), y), list(pm.parameters()), allow_unused=True)
    theirs = torch.autograd.grad(F.mse_loss(eager(x), y), list(eager.parameters()))
    said["own"] = {
        "sharded": sum(isinstance(p, DTensor) for p in pm.parameters()),
        "kinds": sorted({type(g).__name__ for g in mine}),
        "worst": max(_off(_whole(a), b) for a, b in zip(mine, theirs, strict=True)),
        "untouched": all(p.grad is None for p in pm.parameters()),
    }
    by_name = torch.autograd.grad(F.mse_loss(pm(x), y), {"w": dict(pm.named_parameters())["b.weight"]})
    said["own"]["dict"] = _off(_whole(by_name["w"]), theirs[2])
    return said


@pytest.mark.multiproc
def test_backward_inputs_and_autograd_grad_give_eager_gradients_or_are_refused(rank_pool):
    for rank, said in enumerate(rank_pool(2).run(_grad_calls, timeout_s=300)):
        for kind in PLANS:
            got, where = said[kind], f"rank {rank}, {kind}"
            assert got["named"] > 0 and got["worst"] < TOL, f"{where}: backward(inputs=) gave {got}"
            assert got["extra"] == [], f"{where}: parameters backward(inputs=) did not name got gradients: {got['extra']}"
            assert "torch.autograd.grad" in got["refused"] and "loss.backward()" in got["refused"], f"{where}: {got}"
            assert got["untouched"], f"{where}: a refused torch.autograd.grad wrote .grad"
            assert got["after"] < TOL, f"{where}: the backward after the refusal is off eager by {got['after']}"
            # a gradient hook on pm's bucketed parameter got None before the reduction, one on the
            # model's never ran: gradients 0.06 off eager's halved ones
            assert len(got["hooks"]) == 2 or kind != "ddp", f"{where}: {got['hooks']}"
            for said_hook in got["hooks"]:
                assert "register_hook" in said_hook and "before autopar.compile" in said_hook, f"{where}: {got['hooks']}"
        own = said["own"]
        assert own["sharded"] > 0 and own["kinds"] == ["DTensor"], f"rank {rank}: {own}"
        assert own["worst"] < TOL and own["dict"] < TOL, f"rank {rank}: torch.autograd.grad off eager: {own}"
        assert own["untouched"], f"rank {rank}: torch.autograd.grad wrote .grad"


def test_the_wrapped_calls_take_what_torch_takes_for_any_other_model():
    """Once installed, the wrappers pass torch's own inputs through: a generator (read once), one
    tensor, a dict, positional flags."""
    from autopar.runtime import autograd_calls

    autograd_calls.install()
    assert torch.autograd.grad is not autograd_calls._TORCH["grad"], "installed"
    model = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3)
    want = autograd_calls._TORCH["grad"](model(x).sum(), list(model.parameters()))
    for got in (
        torch.autograd.grad(model(x).sum(), model.parameters()),
        torch.autograd.grad(model(x).sum(), tuple(model.parameters()), None, None, False),
        tuple(torch.autograd.grad(model(x).sum(), dict(model.named_parameters())).values()),
    ):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    (alone,) = torch.autograd.grad(model(x).sum(), model.bias)
    assert torch.equal(alone, want[1])
    model(x).sum().backward(inputs=model.parameters())
    assert torch.equal(model.weight.grad, want[0]) and torch.equal(model.bias.grad, want[1])
    model.zero_grad()
    model(x).sum().backward(inputs=model.bias)
    assert model.weight.grad is None and torch.equal(model.bias.grad, want[1])


def _in_backward_steps(module: torch.nn.Module) -> list[bool]:
    """torch's optimizer-in-backward recipe: an SGD per parameter, stepped by its post-accumulate-grad
    hook; returns, per hook call, whether it saw a gradient."""
    optimizers = {p: torch.optim.SGD([p], lr=0.1) for p in module.parameters()}
    seen: list[bool] = []

    def step(param: torch.Tensor) -> None:
        seen.append(param.grad is not None)
        optimizers[param].step()
        optimizers[param].zero_grad()

    for param in module.parameters():
        param.register_post_accumulate_grad_hook(step)
    return seen


def _hooked_steps(rank: int, world: int) -> dict[str, object]:
    """The recipe's hooks on ``pm``'s parameters, on the model's before ``compile`` (the recipe's
    own order, then the wrap), and on the model's after it (the name a DDP script kept)."""
    batch = example_batch("gpt", 8)
    said: dict[str, object] = {}
    for kind in PLANS:
        for where in ("pm", "model before", "model after"):
            model, eager = build_model("gpt").double(), build_model("gpt").double()
            theirs = _in_backward_steps(eager)
            mine = _in_backward_steps(model) if where == "model before" else []
            pm = _under(kind, model, world, batch)
            if where != "model before":
                mine = _in_backward_steps(pm if where == "pm" else model)
            for _ in range(2):
                eager(*batch).backward()
                pm(*batch).backward()
            whole = pm.full_state_dict()
            said[f"{kind}, hooks on {where}"] = {
                "calls": (len(mine), len(theirs)),
                "without_grad": mine.count(False),
                "worst": max(_off(whole[name], value) for name, value in eager.state_dict().items()),
            }
    return said


@pytest.mark.multiproc
def test_post_accumulate_grad_hooks_see_the_reduced_gradient(rank_pool):
    """A hook ran as autograd accumulated into the parameter, before its bucket handed the reduced
    gradient to ``.grad``: it saw None, or the last step's (0.0066 off eager after 2 steps); one on
    the model's parameter never ran, and nothing trained."""
    for rank, said in enumerate(rank_pool(2).run(_hooked_steps, timeout_s=300)):
        assert len(said) == 3 * len(PLANS)
        for case, got in said.items():
            assert got["calls"][0] == got["calls"][1] and got["without_grad"] == 0, f"rank {rank}, {case}: {got}"
            assert got["worst"] < TOL, f"rank {rank}, {case}: parameters off eager by {got['worst']}"


def _torch_in_backward(rank: int, world: int) -> dict[str, object]:
    """``torch.distributed.optim._apply_optimizer_in_backward`` (an Adam per parameter, stepped by a
    hook on its ``AccumulateGrad`` node) over ``pm.parameters()``, two steps against eager's."""
    from torch.distributed.optim import _apply_optimizer_in_backward

    batch = example_batch("gpt", 8)
    said: dict[str, object] = {}
    for kind in PLANS:
        model, eager = build_model("gpt").double(), build_model("gpt").double()
        pm = _under(kind, model, world, batch)
        for module in (pm, eager):
            _apply_optimizer_in_backward(torch.optim.Adam, module.parameters(), {"lr": 0.01})
        for _ in range(2):
            eager(*batch).backward()
            pm(*batch).backward()
        whole = pm.full_state_dict()
        said[kind] = {
            "worst": max(_off(whole[name], value) for name, value in eager.state_dict().items()),
            "grads left": sum(p.grad is not None for p in pm.parameters()),
        }
    return said


@pytest.mark.multiproc
def test_torchs_optimizer_in_backward_steps_on_the_reduced_gradient(rank_pool):
    """Its hooks sit on the parameters' ``AccumulateGrad`` nodes, which a DTensor parameter's
    gradient never passes (fsdp, megatron: nothing stepped, 0.020 off eager after 2 steps) and a
    bucketed one's passes before the bucket reduces it (ddp: steps on ``.grad`` None, 0.010 off),
    and the reduced gradients were left in ``.grad``."""
    for rank, said in enumerate(rank_pool(2).run(_torch_in_backward, timeout_s=300)):
        for kind, got in said.items():
            assert got["worst"] < TOL and got["grads left"] == 0, f"rank {rank}, {kind}: {got}"


class _Classifier(torch.nn.Module):
    """A model that returns its outputs, whose loss the script takes (a DDP image classifier's),
    and the same logits flattened across the batch (an output that is not batched)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)

    def forward(self, x):
        logits = self.b(torch.relu(self.a(x)))
        return logits, logits.reshape(-1)


def _own_rows(rank: int, world: int) -> dict[str, float]:
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 16, generator=generator, dtype=torch.float64), torch.randint(0, 4, (16,), generator=generator)
    torch.manual_seed(0)
    model = _Classifier().double()
    torch.manual_seed(0)
    eager = _Classifier().double()
    pm = autopar.compile(model, (world,), example_inputs=(x,), data=autopar.DataOptions(batch="per_rank"))
    rows = 16 // pm.data_parallel_size
    mine = slice(pm.data_parallel_rank * rows, (pm.data_parallel_rank + 1) * rows)
    F.cross_entropy(eager(x)[0], y).backward()
    said = {"dp": pm.data_parallel_size}
    for how in ("own rows", "whole output's rows"):
        logits, flat = pm(x[mine])
        said["shapes"] = (tuple(logits.shape), tuple(flat.shape))
        if how == "own rows":  # the rank's own rows come back, as DDP's model gives them
            loss = F.cross_entropy(logits, y[mine])
        else:  # a whole output: the script takes its own rows of it
            loss = F.cross_entropy(flat.view(16, 4)[mine], y[mine])
        loss.backward()
        grads = pm.full_grads()
        said[how] = max(_off(grads.get(name), p.grad) for name, p in eager.named_parameters())
        pm.zero_grad()
    for index, how in enumerate(("rows refused", "whole refused")):  # a second backward through either output
        try:
            pm(x[mine])[index].sum().backward(create_graph=True)
            said[how] = "no error"
        except UsageError as error:
            said[how] = str(error)
        pm.zero_grad()
    # a plan saved before outputs left as each rank's rows (its output node takes them whole)
    nodes = {
        name: dataclasses.replace(node, ins=tuple((Replicate(),) for _ in node.ins)) if node.source == "output" else node
        for name, node in pm.plan.nodes.items()
    }
    old = autopar.compile(_Classifier().double(), (world,), example_inputs=(x,), plan=dataclasses.replace(pm.plan, nodes=nodes))
    said["old plan's shapes"] = tuple(tuple(out.shape) for out in old(x[mine]))
    return said


@pytest.mark.multiproc
def test_a_loss_on_each_ranks_own_rows_of_the_outputs_trains_as_ddp_and_eager(rank_pool):
    """Under batch="per_rank" a batched output comes back as the rank's own rows (a DDP script's
    ``criterion(pm(images), target)``), and an output that is not batched comes back whole. A loss
    on a rank's own rows of either trains as DDP: the step is the mean of the ranks' losses',
    eager's over the whole batch. Before, every output was whole: the script's loss met a shape
    error, and one on its own rows of a whole output made the step the sum of the ranks' losses'
    (gradients 2.0 times eager's on 2 ranks)."""
    for rank, said in enumerate(rank_pool(2).run(_own_rows, timeout_s=300)):
        assert said["dp"] == 2, said
        assert said["shapes"] == said["old plan's shapes"] == ((8, 4), (64,)), said
        assert "each rank's rows (batch='per_rank')" in said["rows refused"], said
        assert "comes back whole" in said["whole refused"], said
        assert said["own rows"] < TOL and said["whole output's rows"] < TOL, f"rank {rank}: gradients off eager by {said}"


class _Towers(torch.nn.Module):
    """Two encoders of a contrastive model (CLIP's image and text towers), normalized features."""

    def __init__(self):
        super().__init__()
        self.image, self.text = torch.nn.Linear(12, 8), torch.nn.Linear(10, 8)

    def forward(self, images, texts):
        return F.normalize(self.image(images), dim=-1), F.normalize(self.text(texts), dim=-1)


def _clip_loss(images: torch.Tensor, texts: torch.Tensor) -> torch.Tensor:
    logits, labels = images @ texts.T / 0.1, torch.arange(len(images))
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def _contrastive_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(8, 12, generator=generator, dtype=torch.float64), torch.randn(
        8, 10, generator=generator, dtype=torch.float64
    )


def _contrastive(rank: int, world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """open_clip's DDP loss: each rank all-gathers the features of every rank's rows, with their
    gradients (``torch.distributed.nn.functional.all_gather``), and takes the global batch's loss."""
    import torch.distributed.nn.functional as dist_nn

    torch.manual_seed(0)
    pm = autopar.compile(
        _Towers().double(), (world,), example_inputs=_contrastive_batch(0), data=autopar.DataOptions(batch="per_rank")
    )
    optimizer, rows, losses = torch.optim.SGD(pm.parameters(), lr=0.5), slice(rank * 4, rank * 4 + 4), []
    for step in range(3):
        images, texts = (torch.cat(dist_nn.all_gather(features)) for features in pm(*(t[rows] for t in _contrastive_batch(step))))
        loss = _clip_loss(images, texts)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, pm.full_state_dict()


@pytest.mark.multiproc
def test_a_contrastive_loss_over_every_ranks_gathered_features_equals_eager(rank_pool):
    """The features come back as each rank's rows, so gathering them gives the global batch once, as
    under DDP. They were the global batch's on every rank, and the gather doubled them: the loss
    was 5.23 where eager's is 4.53, without a word."""
    torch.manual_seed(0)
    eager = _Towers().double()
    optimizer, want = torch.optim.SGD(eager.parameters(), lr=0.5), []
    for step in range(3):
        loss = _clip_loss(*eager(*_contrastive_batch(step)))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        want.append(loss.item())
    for losses, state in rank_pool(2).run(_contrastive, timeout_s=300):
        assert losses == pytest.approx(want, rel=1e-12)
        assert max(_off(state[name], value) for name, value in eager.state_dict().items()) < TOL


def _adversarial_step(module, optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """FGSM's adversarial training step on a rank's rows: the input's gradient, then a step on the
    perturbed inputs; returns the input's gradient."""
    x = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(F.cross_entropy(module(x), y), x)
    optimizer.zero_grad()
    F.cross_entropy(module(x.detach() + 3.0 * grad), y).backward()
    optimizer.step()
    return grad


def _penalty_step(module, optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A WGAN-GP critic step on a rank's rows: the gradient penalty at the inputs
    (``create_graph=True``) beside the outputs' mean; returns the penalty and the gradient the
    step's backward left on the inputs (through the penalty's graph alone)."""
    x = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(module(x).sum(), x, create_graph=True)
    penalty = ((grad.norm(dim=1) - 1) ** 2).mean()
    optimizer.zero_grad()
    (module(x.detach() + y.unsqueeze(1)).mean() + 10 * penalty).backward()
    optimizer.step()
    return torch.cat([penalty.detach().view(1), x.grad.flatten()])


def _input_grads(rank: int, world: int) -> dict[str, object]:
    """The same DDP scripts under DDP and under autopar (``batch="per_rank"``, an example input that
    requires grad): FGSM's input gradients, WGAN-GP's penalties, and the parameters after each."""
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 16, generator=generator, dtype=torch.float64), torch.randint(0, 4, (8,), generator=generator)
    rows = slice(rank * 4, rank * 4 + 4)
    said: dict[str, object] = {}
    for name, step in (("fgsm", _adversarial_step), ("penalty", _penalty_step)):
        modules = {}
        for wrap in ("ddp", "autopar"):
            torch.manual_seed(0)
            model = _Classifier().double()
            # a smooth activation: through ReLU's the penalty's graph gives the inputs no gradient
            layers = torch.nn.Sequential(model.a, torch.nn.Tanh() if name == "penalty" else torch.nn.ReLU(), model.b)
            if wrap == "ddp":
                modules[wrap] = torch.nn.parallel.DistributedDataParallel(layers)
            else:
                example = (x.clone().requires_grad_(),)
                modules[wrap] = autopar.compile(
                    layers, (world,), example_inputs=example, data=autopar.DataOptions(batch="per_rank")
                )
        said["dp"] = modules["autopar"].data_parallel_size
        got = {}
        for wrap, module in modules.items():
            optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
            got[wrap] = [step(module, optimizer, x[rows], y[rows]) for _ in range(2)]
        said[name] = max((a - b).abs().max().item() for a, b in zip(got["autopar"], got["ddp"]))
        whole = modules["autopar"].full_state_dict()
        said[f"{name} params"] = max(_off(whole[key], value) for key, value in modules["ddp"].module.state_dict().items())
    return said


@pytest.mark.multiproc
def test_an_inputs_gradient_and_a_gradient_penalty_are_ddps(rank_pool):
    """The row outputs' ``1 / data_parallel_size`` (DDP's average of the parameters' gradients)
    reached the input's gradient too: an FGSM step's was half DDP's on 2 ranks, before it was given
    back. A gradient penalty's second backward summed the ranks' penalties where DDP averages them
    (parameters 507 off DDP's after 3 WGAN-GP steps, on the code before batched outputs came back as
    each rank's rows too); through the penalty's graph the inputs' gradient was half DDP's."""
    for rank, said in enumerate(rank_pool(2).run(_input_grads, timeout_s=300)):
        assert said["dp"] == 2, said
        assert all(value < TOL for key, value in said.items() if key != "dp"), f"rank {rank}: {said}"
