"""Optimizers that step each parameter where its state lives.

``autopar.optim.AdamW(pm.parameters(), lr=...)`` (or ``AdamW(pm, ...)``) is ``torch.optim.AdamW``
(the same arguments, param groups included, and the same update, element for element) for a
``ParallelModule`` whose plan offloads parameters, gradients or optimizer state
(``plan.memory``). It steps one parameter at a time: it reads what is offloaded of that
parameter (value, gradient, exp_avg, exp_avg_sq) from the offload store onto the compute
device, updates it, writes back what is offloaded, and frees it before the next parameter; with
prefetch it reads the next parameter's tensors, and writes the last one's, on the store's thread
meanwhile. So the device
never holds more than one parameter's offloaded state (two with prefetch). It steps the
parameters whose state is resident first, so that the first offloaded read overlaps their updates. Parameters whose state is not offloaded
keep it resident, as torch's optimizer would.

For a module that offloads nothing it is a plain AdamW over ``pm.parameters()``.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from autopar.errors import ConfigError, ConfigTypeError
from autopar.ops.params import as_like, local_of
from autopar.runtime import stale_model
from autopar.runtime.offload import grad_key, param_key


class AdamW(torch.optim.Optimizer):
    """AdamW over a ParallelModule's parameters, offload-aware (see the module docstring). A
    ``torch.optim.Optimizer`` that takes what ``torch.optim.AdamW`` takes: the module's parameters
    or param groups of them (``AdamW(pm.parameters(), lr=...)``; Hugging Face Trainer's groups,
    which leave biases and norms out of the weight decay), or the module itself (one group of its
    trainable parameters). torch's schedulers, ``state_dict()``/``load_state_dict()`` and
    ``autopar.checkpoint`` read and write it; each parameter's state is torch AdamW's (``step``,
    ``exp_avg``, ``exp_avg_sq``), so a state saved by either loads into the other. Where the plan
    offloads it, it lives in the store and ``state_dict()`` reads it back; state put in
    ``self.state`` (a load) goes to the store at the next step."""

    steps_offloaded_state = True  # for ``runtime.optim_guard``: what this optimizer steps is the plan's own

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        **kernels: bool | None,
    ):
        """``torch.optim.AdamW``'s arguments. ``kernels``: torch's ``foreach`` and ``fused``, which
        choose its kernels over many tensors (this steps one tensor at a time either way: the same
        update), and ``capturable`` and ``differentiable``. ``amsgrad``, ``capturable`` and
        ``differentiable`` are refused: it keeps two moments a parameter, as the plan priced, and
        steps outside autograd and CUDA graphs."""
        if not lr >= 0 or not eps >= 0 or not all(0 <= b < 1 for b in betas):
            raise ConfigError(f"AdamW needs lr >= 0, eps >= 0 and betas in [0, 1), got lr={lr}, eps={eps}, betas={betas}")
        unknown = sorted(set(kernels) - set(_KERNELS))
        if unknown:
            raise ConfigTypeError(
                f"AdamW got unexpected keyword arguments {unknown}: it takes torch.optim.AdamW's (lr, betas, eps, "
                f"weight_decay, amsgrad, maximize, {', '.join(_KERNELS)})"
            )
        _refuse_options({"amsgrad": amsgrad, **kernels})
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay, "maximize": maximize}
        if isinstance(params, torch.nn.Module):
            module = params
            names = _canonical_names(module)
            trainable = {id(p): p for _, p in module.named_parameters(remove_duplicate=False) if p.requires_grad}
            super().__init__(list(trainable.values()), defaults)
        else:
            super().__init__(params, defaults)
            module = _owner([p for group in self.param_groups for p in group["params"]])
            names = _canonical_names(module) if module is not None else {}
        self.module = module
        self.offloader = getattr(module, "offloader", None)
        self._names = names

    @property
    def params(self) -> list[tuple[str, torch.Tensor]]:
        """(FQN, parameter) of every group's parameters in order, a group added since included; a
        tensor of no compiled module is named by its place (its state stays resident)."""
        flat = (p for group in self.param_groups for p in group["params"])
        return [(self._names.get(id(p), f"<parameter {k} of no compiled module>"), p) for k, p in enumerate(flat)]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's; a group added after construction (layers unfrozen as training goes) is stepped
        as the first ones are, so its parameters must be of this optimizer's compiled module."""
        super().add_param_group(param_group)
        if "_names" not in self.__dict__:  # from torch's __init__: the owner is found after
            return
        owner = _owner(self.param_groups[-1]["params"])
        if owner is not None and owner is not self.module:
            self.param_groups.pop()  # refused: the optimizer stays as it was
            raise ConfigError(
                "add_param_group got parameters of another compiled module than this optimizer's first groups: "
                "build one optimizer per module (each steps its parameters where its own plan keeps their state)"
            )

    def _offloaded(self, kind: str, fqn: str) -> bool:
        return self.offloader is not None and fqn in getattr(self.offloader, kind)

    def _offloads_any(self, fqn: str) -> bool:
        """Whether the plan offloads anything of parameter ``fqn``: its value, gradient or state."""
        return any(self._offloaded(kind, fqn) for kind in ("params", "grads", "states"))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for _, param in self.params:
            param.grad = None
        if self.offloader is not None:
            self.offloader.clear_grads()

    def _prefetch(self, fqn: str, param: torch.Tensor) -> None:
        store = self.offloader.store
        if self._offloaded("params", fqn):
            store.prefetch(param_key(fqn))
        if self._offloaded("grads", fqn):
            store.prefetch(grad_key(fqn))
        if self._offloaded("states", fqn) and self.state.get(param):
            for name in MOMENTS:
                store.prefetch(state_key(name, fqn))

    def _stepping_order(self, params: list[tuple[str, torch.Tensor]] | None = None) -> list[tuple[str, torch.Tensor]]:
        """``params`` (``self.params``, where the caller has none), those whose tensors live on the
        device first, offloaded ones last: with prefetch the first offloaded read then runs behind
        the resident updates instead of stalling the step (each parameter's update is its own, so
        the order changes no number)."""
        return sorted(self.params if params is None else params, key=lambda item: self._offloads_any(item[0]))

    def _stow(self, params: list[tuple[str, torch.Tensor]] | None = None) -> None:
        """Move the moments of parameters whose state the plan offloads from ``self.state`` (where a
        load put them) to the store (``params``: ``self.params``, where the caller has it)."""
        for fqn, param in self.params if params is None else params:
            state = self.state.get(param)
            if state and self._offloaded("states", fqn) and any(name in state for name in MOMENTS):
                for name in MOMENTS:
                    self.offloader.store.put(state_key(name, fqn), state.pop(name).to(local_of(param).device))

    @contextlib.contextmanager
    def state_in_hand(self) -> Iterator[None]:
        """Inside, ``self.state`` holds every moment, the offloaded ones read from the store to
        the host, where the device need not hold them all (for ``state_dict()`` and
        ``autopar.checkpoint.save``); after, it holds them as before."""
        self._stow()
        kept = {}
        for fqn, param in self.params:
            state = self.state.get(param)
            if state and self._offloaded("states", fqn):
                kept[param] = state
                self.state[param] = {
                    **state,
                    **{name: self.offloader.store.get_on_host(state_key(name, fqn)) for name in MOMENTS},
                }
        try:
            yield
        finally:
            self.state.update(kept)

    def state_dict(self) -> dict[str, Any]:
        with self.state_in_hand():
            return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's; a state saved by a torch AdamW with an option this one does not step
        (``amsgrad``: a third moment) is refused before anything is loaded."""
        for group in state_dict.get("param_groups", ()):
            _refuse_options({name: group.get(name, False) for name in _REFUSED})
        super().load_state_dict(state_dict)
        self._stow()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = self.params  # once a step: derived from the groups
        self._stow(params)
        store = self.offloader.store if self.offloader is not None else None
        if store is not None:
            store.take_back()  # weights loaded in place into pm.state_dict()'s copies (dcp.load)
            params = self._stepping_order(params)
        prefetch = self.offloader is not None and self.offloader.memory.prefetch
        if prefetch:  # the first offloaded parameter's read, behind the resident updates
            first = next(((fqn, p) for fqn, p in params if self._offloads_any(fqn)), None)
            if first is not None:
                self._prefetch(*first)
        if self.module is not None:
            stale_model.stepped(self.module)  # the model passed to compile is behind it now
        groups = {id(p): group for group in self.param_groups for p in group["params"]}
        for k, (fqn, param) in enumerate(params):
            if prefetch and k + 1 < len(params):
                self._prefetch(*params[k + 1])
            if id(param) in groups:
                self._step_one(fqn, param, groups[id(param)], store, prefetch)
        return loss

    def _step_one(self, fqn: str, param: torch.Tensor, group: dict, store: Any, prefetch: bool) -> None:
        grad = self.offloader.grad(fqn, param) if self._offloaded("grads", fqn) else param.grad
        if grad is None:
            return
        # A DTensor parameter (and its gradient) is stepped on its local shard: the update is
        # elementwise, so no DTensor dispatch is needed.
        grad = local_of(grad)
        value = store.get(param_key(fqn)) if self._offloaded("params", fqn) else local_of(param)
        state = self.state[param]
        offloaded_state = self._offloaded("states", fqn)
        if not state:
            state["step"] = torch.tensor(0.0)
            exp_avg, exp_avg_sq = torch.zeros_like(value), torch.zeros_like(value)
        elif offloaded_state:
            exp_avg, exp_avg_sq = (store.get(state_key(name, fqn)) for name in MOMENTS)
        else:
            exp_avg, exp_avg_sq = (local_of(state[name]) for name in MOMENTS)
        state["step"] += 1
        lr, betas, eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        grad = -grad if group.get("maximize", False) else grad  # (a group loaded from before the option has none)
        _adamw_update(value, grad, exp_avg, exp_avg_sq, int(state["step"]), lr, betas, eps, weight_decay)
        if offloaded_state:  # with prefetch, written behind the next parameter's update
            for name, moment in zip(MOMENTS, (exp_avg, exp_avg_sq), strict=True):
                store.put(state_key(name, fqn), moment, wait=not prefetch)
        elif "exp_avg" not in state:
            state["exp_avg"], state["exp_avg_sq"] = (as_like(m, param) for m in (exp_avg, exp_avg_sq))
        if self._offloaded("params", fqn):
            store.put(param_key(fqn), value, wait=not prefetch)


MOMENTS = ("exp_avg", "exp_avg_sq")
_REFUSED = ("amsgrad", "capturable", "differentiable")  # torch AdamW's options that AdamW here does not step
_KERNELS = ("foreach", "fused", "capturable", "differentiable")  # torch AdamW's choices of its kernels


def _refuse_options(options: dict[str, Any]) -> None:
    """ConfigError naming the options of ``_REFUSED`` set in ``options``."""
    refused = [name for name in _REFUSED if options.get(name)]
    if refused:
        raise ConfigError(
            f"autopar.optim.AdamW does not take {', '.join(f'{name}=True' for name in refused)}: it keeps AdamW's two "
            "moments a parameter where the plan put them, outside autograd and CUDA graphs. Where the plan offloads "
            "nothing, torch.optim.AdamW takes them; an offloading plan is priced for two moments (plan with "
            'offload="off", or without the option)'
        )


# parameter -> a weak reference to the compiled module that holds it (``own_parameters``)
_OWNERS = WeakIdKeyDictionary()


def own_parameters(module: torch.nn.Module) -> None:
    """Record ``module`` (a compiled module) as the owner of its parameters, so that ``AdamW``
    built from them, as ``torch.optim.AdamW`` is, finds the module whose plan may offload them."""
    ref = weakref.ref(module)
    for param in module.parameters():
        _OWNERS[param] = ref


def owner_of(param: torch.Tensor) -> Any:
    """The live compiled module that holds ``param``, or None."""
    ref = _OWNERS.get(param)
    return ref() if ref is not None else None


def _owner(params: list[torch.Tensor]) -> Any:
    """The one compiled module that holds ``params`` (None: none does); two are refused."""
    owners: dict[int, Any] = {}
    for param in params:
        module = owner_of(param)
        if module is not None:
            owners[id(module)] = module
    if len(owners) > 1:
        raise ConfigError(
            f"AdamW got the parameters of {len(owners)} compiled modules: build one optimizer per module "
            "(each steps its parameters where its own plan keeps their state)"
        )
    return next(iter(owners.values()), None)


def _canonical_names(module: torch.nn.Module) -> dict[int, str]:
    """id(parameter) -> its FQN in the original model (a tied one's canonical name), as the plan
    and the offload store name it."""
    ties = getattr(module, "ties", None) or {}  # a ParallelModule's tied names; none on a plain module
    names: dict[int, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        fqn = name.removeprefix("module.")
        names.setdefault(id(param), ties.get(fqn, fqn))
    return names


def state_key(name: str, fqn: str) -> str:
    """The store key of moment ``name`` of parameter ``fqn``."""
    return f"{name}/{fqn}"


def _adamw_update(param, grad, exp_avg, exp_avg_sq, step: int, lr, betas, eps, weight_decay) -> None:
    """torch.optim.AdamW's single-tensor update (``torch/optim/adam.py``, decoupled decay)."""
    beta1, beta2 = betas
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad.conj(), value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


__all__ = ["AdamW", "own_parameters", "owner_of"]
