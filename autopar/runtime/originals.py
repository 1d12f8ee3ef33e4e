"""The parameters of a model passed to ``autopar.compile`` stay the model's own objects: the
compiled module holds its own parameters (sharing the model's storage where it holds a tensor
whole: ``stale_model``) and never writes gradients into the model's. A DDP script builds its
optimizer before the wrap, on the model's own parameters (nanoGPT's ``configure_optimizers``),
and DDP trains them in place. A torch optimizer step pre-hook (registered at the first
``compile``) therefore looks at an optimizer whose parameters include such originals when none
of those has a gradient (the same model trained eagerly beside ``pm`` has them, and steps), and
the step takes no closure (which makes the gradients inside it): where the compiled module that
holds them is alive (``bind``), it re-binds the optimizer to that module's parameters, once,
before this first step (its state too, as a resumed script loads it: each whole tensor cut to the
parameter's shard, a DTensor with its placements) and logs it; otherwise (a pipeline, an
offloading plan, a module that is gone) it refuses the step, which would train nothing. Each
optimizer is checked when its parameter count changes, not at every step.

The gradients are linked the same way. A script that wrapped its model under another name
(``ddp_model = DDP(model)``, then ``autopar.compile``) clips, zeroes and freezes through the
model's own parameters, which under DDP are the trained ones: ``clip_grad_norm_(model.parameters(),
1.0)`` would clip nothing, ``model.zero_grad()`` zero nothing and ``model.requires_grad_(False)``
freeze nothing, without a word. So at ``compile`` each parameter's class becomes ``_Linked``, a
``Parameter`` whose ``.grad``, where autograd gave it none, is the compiled module's parameter's
(``bind``; a DTensor where the plan shards it): a clip scales ``pm``'s gradients as
``clip_grad_norm_(pm.parameters())`` does, setting it to ``None`` (``zero_grad``) clears ``pm``'s,
and setting ``requires_grad`` sets ``pm``'s too. Where no parameter of ``pm`` stands for it (a
pipeline's stages, an offloading plan) these raise a ``UsageError`` naming ``pm.clip_grad_norm_``.
A post-accumulate-grad hook on the model's parameter (torch's optimizer-in-backward recipe, set up
before or after the wrap) runs when its twin gets its gradient, with the model's parameter
(``_Relay``): under DDP it would run on the parameter that trains.
A model trained beside ``pm`` (its own forward in training, or a gradient of its own) keeps its
own gradients from then on, and gets weights of its own (``on_trains_itself``). A parameter whose
value ``pm`` trained past in a shard of its own becomes ``_Stale`` (``mark_stale``), which
refuses reading that value.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import weakref
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from autopar.errors import UsageError
from autopar.ops.params import grad_hook_refused

_ORIGINALS: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
# id(original parameter) → its binding to the compiled module (``_Binding``)
_BINDINGS: dict[int, _Binding] = {}
_CHECKED: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
_HOOK: list[Any] = []
log = logging.getLogger("autopar")


_GRAD = torch._C.TensorBase.grad  # the gradient autograd accumulates into a tensor (the C field)
_REQUIRES_GRAD = torch._C.TensorBase.requires_grad


class _Model:
    """What the bindings of one model share: whether it has trained itself (``trains_itself``), and
    what to do then (``on_itself``: ``stale_model`` gives the model back weights of its own)."""

    __slots__ = ("itself", "on_itself", "__weakref__")

    def __init__(self) -> None:
        self.itself = False
        self.on_itself: list[Any] = []

    def trains(self) -> None:
        if not self.itself:
            self.itself = True
            for then in self.on_itself:
                then()


_MODELS: weakref.WeakKeyDictionary[torch.nn.Module, _Model] = weakref.WeakKeyDictionary()


class _Binding(NamedTuple):
    param: weakref.ref  # the model's parameter
    owner: weakref.ref  # the compiled module
    fqn: str | None  # its name in the compiled module; None where its gradient cannot be pm's
    model: _Model


class _Linked(torch.nn.Parameter):
    """A parameter of a model passed to ``compile``: its ``.grad``, where autograd gave it none,
    is the compiled module's, and its ``requires_grad`` is set on both (see the module docstring)."""

    @property
    def grad(self) -> torch.Tensor | None:  # type: ignore[override]
        own = _GRAD.__get__(self)
        if own is not None:
            _trains_itself(self)
            return own
        if sys._getframe(1).f_globals.get("__name__", "").startswith("torch._"):
            return None  # torch's own machinery: export's and dynamo's fake copies of the model read its own
        twin = _twin(self, "read or clear its gradient")
        return None if twin is None else twin.grad

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        if value is None and _GRAD.__get__(self) is None and (twin := _twin(self, None)) is not None:
            twin.grad = None  # the model's zero_grad() is the compiled module's
            return
        _GRAD.__set__(self, value)

    @grad.deleter
    def grad(self) -> None:
        self.grad = None

    @property
    def requires_grad(self) -> bool:  # type: ignore[override]
        return _REQUIRES_GRAD.__get__(self)

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        twin = _twin(self, "freeze or unfreeze it" if value != _REQUIRES_GRAD.__get__(self) else None)
        _REQUIRES_GRAD.__set__(self, value)
        if twin is not None:
            twin.requires_grad = value  # freezing the model's is freezing the compiled module's

    def requires_grad_(self, requires_grad: bool = True) -> _Linked:  # type: ignore[override]
        self.requires_grad = requires_grad
        return self

    def register_hook(self, hook: Any) -> Any:  # type: ignore[override]
        """Torch's, where the model's parameter gets gradients of its own; refused where the compiled
        module's gets them (the hook would never run)."""
        twin = _twin(self, None)
        if twin is not None and twin is not self:
            raise grad_hook_refused("the compiled module's parameter gets the gradients, not the model's")
        return super().register_hook(hook)

    def register_post_accumulate_grad_hook(self, hook: Any) -> Any:  # type: ignore[override]
        """Torch's, and the same hook on the compiled module's parameter (``_Relay``), which is the
        one that gets gradients; the handle removes both."""
        handle = super().register_post_accumulate_grad_hook(hook)
        twin = _twin(self, None)
        if twin is None or twin is self:
            return handle
        return _Handles((handle, twin.register_post_accumulate_grad_hook(_Relay(self, hook))))

    def __repr__(self) -> str:
        return f"Parameter containing:\n{self.detach()!r}"


class _Relay:
    """A post-accumulate-grad hook of a model's parameter, run when its twin in the compiled module
    (``_twin``) gets its gradient, with the model's parameter, whose ``.grad`` reads the twin's: the
    optimizer-in-backward recipe (an optimizer per parameter, stepped by the hook) steps ``pm``'s,
    as DDP's hooks step the parameters it trains. Skipped once the model trains itself or is
    compiled again (its parameter has another twin, or none)."""

    def __init__(self, param: torch.Tensor, hook: Any):
        self.param, self.hook = weakref.ref(param), hook

    def __call__(self, twin: torch.Tensor) -> None:
        param = self.param()
        if param is not None and _twin(param, None) is twin:
            self.hook(param)


class _Handles(NamedTuple):
    handles: tuple[Any, ...]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class _Stale(_Linked):
    """A parameter of the model whose values ``pm`` has trained past in a shard of its own
    (``stale_model`` gives it this class while so, ``mark_stale``): reading its values (an EMA of
    the model, ``p.data``, a copy) raises, where it would read the weights from before training
    without a word. Its metadata, its gradient (``pm``'s), moving it and writing it whole pass,
    and so does autopar's own tracing of the model (``QUIET``)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if QUIET[0] or func in _METADATA or torch.compiler.is_compiling() or _writes_whole(func, args):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        owner = getattr(func, "__self__", None)  # a getter's descriptor (p.data)
        name = f".{owner.__name__}" if getattr(func, "__name__", "") == "__get__" else getattr(func, "__name__", str(func))
        raise UsageError(
            f"a parameter of the model passed to autopar.compile was read ({name}) after the compiled module trained "
            "past it: under this plan pm holds its own shard of it, so the model still holds the value from before "
            "training (an EMA, a copy or another compile of the model would take those, without a word). Read pm's: "
            "pm.module's parameters (AveragedModel(pm), update_parameters(pm); a DTensor's .full_tensor() gathers "
            "one, on every rank), or load the trained weights back first: model.load_state_dict(pm.module.state_dict())"
        )

    def __repr__(self) -> str:
        with torch._C.DisableTorchFunctionSubclass():
            return super().__repr__()


def _getter_or_method(name: str) -> Any:
    attribute = getattr(torch.Tensor, name)
    return attribute.__get__ if hasattr(attribute, "__set__") else attribute


QUIET = [0]  # > 0 while autopar reads the model's values (``own_reads``: its traces and compiles too)


@contextlib.contextmanager
def own_reads() -> Iterator[None]:
    """autopar's own reads of the model's values (a load mirrored into ``pm``, a copy for a model
    that trains itself) pass ``_Stale``."""
    QUIET[0] += 1
    try:
        yield
    finally:
        QUIET[0] -= 1


# what a tensor is, not what it holds (``is_*`` but is_nonzero: export reads these to make its fake copy)
_KINDS = tuple(name for name in dir(torch.Tensor) if name.startswith("is_") and name != "is_nonzero")
_KINDS += ("_is_view", "_is_zerotensor")
_GETTERS = ("shape", "dtype", "device", "layout", "ndim", "requires_grad", "grad", "grad_fn", "_version", "names")
_GETTERS += ("output_nr", "_base", "grad_dtype", "itemsize", "nbytes")
_METHODS = ("size", "dim", "numel", "nelement", "element_size", "data_ptr", "untyped_storage", "storage_offset")
_METHODS += ("stride", "get_device", "requires_grad_")
_METHODS += ("register_hook", "register_post_accumulate_grad_hook", "retain_grad", "_has_compatible_shallow_copy_type")
_METHODS += ("to", "cpu", "cuda")  # moving the model (model.cpu()): the moved tensor is the parameter's again
_METHODS += ("__hash__", "__len__", "__dir__", "__format__")  # a dict key, len(), dir(), display (as repr)
_METADATA = frozenset(
    [getattr(torch.Tensor, name).__get__ for name in _GETTERS if hasattr(torch.Tensor, name)]
    + [_getter_or_method(name) for name in _KINDS]
    + [getattr(torch.Tensor, name).__set__ for name in ("grad", "requires_grad", "data")]
    + [getattr(torch.Tensor, name) for name in _METHODS if hasattr(torch.Tensor, name)]
    + [torch._has_compatible_shallow_copy_type]  # Module._apply's, before it sets .data
)
# writes that read nothing of the tensor they write (a load's copy_, an initializer's)
_WHOLE_WRITES = frozenset(getattr(torch.Tensor, name) for name in ("copy_", "fill_", "zero_", "normal_", "uniform_"))


def _writes_whole(func: Any, args: tuple) -> bool:
    return func in _WHOLE_WRITES and not any(isinstance(value, _Stale) for value in args[1:])


def mark_stale(params: list[torch.Tensor], stale: bool) -> None:
    """Give each of ``params`` (the model's, bound or watched here) the class that refuses reading
    its values (``stale``), or back the one that does not."""
    old, new = (_Linked, _Stale) if stale else (_Stale, _Linked)
    for param in params:
        if type(param) is old:
            param.__class__ = new


def _twin(param: torch.Tensor, refused: str | None) -> torch.Tensor | None:
    """The compiled module's parameter that ``param`` is bound to, while both live and the model
    has not trained itself. Where the plan gives the model's parameters no such twin (a pipeline,
    an offloading plan), ``refused`` (what the caller would do) raises, naming the fix."""
    binding = _BINDINGS.get(id(param))
    if binding is None or binding.model.itself or binding.param() is not param:
        return None
    pm = binding.owner()
    if pm is None:
        return None
    if binding.fqn is not None:
        return pm.held_tensor(binding.fqn)
    if refused is not None:
        raise UsageError(
            f"a parameter of the model passed to autopar.compile was used to {refused}, but under this plan "
            f"({'an offloading plan' if pm.offloader is not None else 'a pipeline'}) the compiled module's "
            "parameters cannot stand in for the model's, as they do under DDP: it would do nothing, without a word. "
            "Go through the compiled module: build the optimizer from pm.parameters() and clear with its "
            "zero_grad(), clip with pm.clip_grad_norm_(max_norm), and freeze pm.module's parameters (a pipeline "
            "traces which parameters train at compile: freeze them before it)"
        )
    return None


def _trains_itself(param: torch.Tensor) -> None:
    binding = _BINDINGS.get(id(param))
    if binding is not None and binding.param() is param:
        binding.model.trains()


def trained_itself(model: torch.nn.Module) -> bool:
    """Whether ``model`` has trained itself since it was compiled (``trains_itself``)."""
    shared = _MODELS.get(model)
    return shared is not None and shared.itself


def trains_itself(model: torch.nn.Module) -> None:
    """``model``'s own forward ran in training: a model trained beside its compiled module keeps
    its own gradients and weights (``stale_model``'s forward guard calls this)."""
    if (shared := _MODELS.get(model)) is not None:
        shared.trains()


def on_trains_itself(model: torch.nn.Module, then: Any) -> None:
    """Call ``then()`` once, when ``model`` first trains itself (``trains_itself``)."""
    _MODELS.setdefault(model, _Model()).on_itself.append(then)


def watch(model: torch.nn.Module, pm: torch.nn.Module) -> None:
    """Remember ``model``'s parameters (weakly): the ones ``pm`` does not train. Until ``bind``
    names their twins, using them for ``pm``'s gradients or freezing is refused (``_Linked``)."""
    owner, shared = weakref.ref(pm), _MODELS.setdefault(model, _Model())
    for param in model.parameters():
        _ORIGINALS[id(param)] = param
        _BINDINGS[id(param)] = _Binding(weakref.ref(param), owner, None, shared)
        if type(param) is torch.nn.Parameter:
            param.__class__ = _Linked
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(rebind_optimizer))


def bind(model: torch.nn.Module, pm: torch.nn.Module, fqns: set[str]) -> None:
    """Let an optimizer over ``model``'s parameters named in ``fqns`` be re-bound to ``pm``'s
    (``pm.held_tensor(fqn)``, ``pm.shard_like(fqn, whole)`` for its state), their gradients
    read and clear ``pm``'s (``_Linked``), and their post-accumulate-grad hooks run on ``pm``'s
    (``_Relay``)."""
    owner, shared = weakref.ref(pm), _MODELS.setdefault(model, _Model())
    for fqn, param in model.named_parameters(remove_duplicate=False):
        if fqn in fqns:
            _BINDINGS[id(param)] = _Binding(weakref.ref(param), owner, fqn, shared)
    for fqn, param in model.named_parameters():  # hooks registered before compile run on the twin's gradient
        if fqn in fqns and param._post_accumulate_grad_hooks:
            twin = pm.held_tensor(fqn)
            for hook in tuple(param._post_accumulate_grad_hooks.values()) if twin is not param else ():
                twin.register_post_accumulate_grad_hook(_Relay(param, hook))


def _targets(originals: list[torch.Tensor]) -> dict[int, tuple[Any, str]] | None:
    """id(original) → (its live compiled module, FQN) for each of ``originals``, or None if one has none."""
    out = {}
    for param in originals:
        binding = _BINDINGS.get(id(param))
        pm = binding.owner() if binding is not None and binding.param() is param else None
        if pm is None or binding.fqn is None:
            return None
        out[id(param)] = (pm, binding.fqn)
    return out


def _rebind(optimizer: torch.optim.Optimizer, targets: dict[int, tuple[Any, str]]) -> None:
    """Swap each original in ``optimizer`` for its compiled module's parameter, state included."""
    bound: dict[int, tuple[Any, str]] = {}
    for group in optimizer.param_groups:
        params = []
        for param in group["params"]:
            if id(param) not in targets:
                params.append(param)
                continue
            pm, fqn = targets[id(param)]
            new = pm.held_tensor(fqn)
            state = optimizer.state.pop(param, None)
            if state:
                optimizer.state[new] = {
                    key: pm.shard_like(fqn, value) if _whole(value, param) else value for key, value in state.items()
                }
            params.append(new)
            bound[id(new)] = (pm, fqn)
        group["params"] = params
    _keep_whole_state_dicts(optimizer, bound)
    log.info(
        "autopar: %s was built on the parameters of the model passed to autopar.compile; it now steps the compiled "
        "module's (%d parameters), as DDP trains the model's own",
        type(optimizer).__name__,
        len(targets),
    )


def _keep_whole_state_dicts(optimizer: torch.optim.Optimizer, bound: dict[int, tuple[Any, str]]) -> None:
    """The re-bound optimizer's ``state_dict()`` stays what the script's plain model had (whole
    tensors, which ``torch.save`` writes and a plain optimizer loads: gathered where the plan shards
    a parameter, so every rank calls it then), and ``load_state_dict`` of one cuts it to shards."""

    def whole(opt: torch.optim.Optimizer, state_dict: dict) -> dict:
        # new dicts: the packed state shares each parameter's dict with the live optimizer's
        state_dict["state"] = {
            index: {key: value.full_tensor() if isinstance(value, DTensor) else value for key, value in per_param.items()}
            for index, per_param in state_dict["state"].items()
        }
        return state_dict

    def cut(opt: torch.optim.Optimizer) -> None:
        for param, per_param in opt.state.items():
            if id(param) not in bound:
                continue
            pm, fqn = bound[id(param)]
            for key, value in per_param.items():
                if not isinstance(value, DTensor) and _whole(value, param):
                    per_param[key] = pm.shard_like(fqn, value)

    optimizer.register_state_dict_post_hook(whole)
    optimizer.register_load_state_dict_post_hook(cut)


def _whole(value: Any, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.shape


def rebind_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The step pre-hook: re-bind an optimizer over a compiled model's own parameters to the
    module's, or refuse it (module docstring); once per optimizer, so that other hooks may call
    it first (``optim_guard``, which checks the parameters it will step)."""
    # LBFGS and the like make their gradients inside the step (args[0] is the optimizer)
    if args[1:] or kwargs.get("closure") is not None:
        return
    num_params = sum(len(group["params"]) for group in optimizer.param_groups)
    if _CHECKED.get(optimizer) == num_params:
        return
    originals = [p for group in optimizer.param_groups for p in group["params"] if _ORIGINALS.get(id(p)) is p]
    for param in originals:  # the model trained beside pm: it steps weights of its own from now on
        if _GRAD.__get__(param) is not None:
            _trains_itself(param)
    if originals and all(_GRAD.__get__(p) is None for p in originals):
        targets = _targets(originals)
        if targets is not None:
            _rebind(optimizer, targets)
            _CHECKED[optimizer] = num_params
            return
        raise UsageError(
            f"{type(optimizer).__name__} steps {len(originals)} parameters of the model passed to autopar.compile, "
            "which the compiled module does not use: they get no gradients, and nothing would train. Build the "
            "optimizer from the compiled module's parameters: "
            f"opt = torch.optim.{type(optimizer).__name__}(pm.parameters(), ...)"
        )
    _CHECKED[optimizer] = num_params
