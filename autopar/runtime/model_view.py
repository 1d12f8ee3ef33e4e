"""``pm.module``: the user's model, distributed, as DDP's ``model.module`` is the model.

A compiled module holds its shards under the model's own names. Instead of empty holders, the
tree that holds them is made of the model's own classes (a shell of each submodule: its
``__dict__`` less its tensors, sharing its config and other attributes), so that the model's
methods, properties and attributes work on it. The root's class is, as FSDP2's ``fully_shard``
does it, a dynamic subclass of the model's class (``isinstance(pm.module, GPT)`` holds) that
changes four things:

- calling it (``self(...)``, ``self.forward(...)``) runs the compiled module's forward, so a
  method such as ``generate`` that calls the model runs the distributed graph;
- ``state_dict()`` is the whole model's, gathered (``pm.full_state_dict()``): what DDP's
  ``model.module.state_dict()`` gives, which ``torch.save`` writes and a plain model loads;
- ``load_state_dict`` copies whole tensors into the shards (``pm.load_state_dict``);
- ``train()`` and ``eval()`` switch the compiled module too (a submodule's switch,
  ``pm.module.backbone.eval()``, is that module's mode, which a call runs as eager does:
  ``runtime.modes``).

A method that reads a parameter directly (``self.lm_head.weight``, ``self.parameters()``) sees
the parameter ``pm`` trains (plain where the plan replicates every parameter), or the DTensor: its shape, ``numel()`` and ``dim()`` are the whole tensor's (so
``get_num_params`` and ``configure_optimizers`` give eager's answers and build the optimizer on
``pm``'s parameters), ``.full_tensor()`` gathers it, ``.to_local()`` is this rank's shard. A
submodule called directly (``self.transformer.wte(idx)``) would run eagerly on DTensors and fail
on plain inputs: call the model itself. The compiled module's other attribute lookups fall
through to this one (``ModelAttributes.__getattr__``): ``pm.config``, ``pm.generate(...)``.

A pipelined module (``PipelineParallelModule``) has the same view over the shards of this rank's
stage: a method that reads parameters sees those only (plain tensors, the stage's shards; the other
stages' modules hold none), ``state_dict()`` is still the whole model's (gathered from every stage),
and calling the model runs a pipeline step, which returns the loss alone (so ``generate`` cannot run).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from autopar.errors import ConfigError
from autopar.runtime.pickling import NotPickled

# The hook tables of ``pm.module``'s shells start empty: the model's own hooks were traced into
# the graph, and the root runs that graph (a copied root hook would apply twice). Each shell keeps
# its model module's hooks aside (``_SAVED_HOOKS``) for ``local_model``, which runs the model
# eagerly and so must run them as eager does.
_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)
_SAVED_HOOKS = "_autopar_model_hooks"
_CLASSES: dict[type, type] = {}


class DistributedModel(NotPickled):
    """Mixed in before the model's class at the root of ``pm.module`` (see the module docstring)."""

    _autopar_owner: Any  # the ParallelModule, in __dict__: not a submodule (that would be a cycle)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._autopar_owner(*args, **kwargs)

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """The whole model's ``state_dict()`` (``pm.full_state_dict()``), as DDP's
        ``model.module.state_dict()``. A gather over the mesh where the plan shards a tensor:
        every rank calls it then; a plan that replicates every tensor needs no communication."""
        out = self._autopar_owner.full_state_dict()
        if destination is None:
            return out if not prefix else {prefix + key: value for key, value in out.items()}
        for key, value in out.items():
            destination[prefix + key] = value
        return destination

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        return self._autopar_owner.load_state_dict(state_dict, strict=strict, assign=assign)

    def train(self, mode: bool = True) -> Any:
        """``pm.module.train()`` and ``.eval()`` switch the compiled module, as DDP's
        ``model.module.eval()`` switches DDP's forward: ``pm`` and every module take ``mode``."""
        owner = self._autopar_owner
        if owner.training != mode:
            owner.train(mode)  # which comes back here for this tree
            return self
        return super().train(mode)

    # Hugging Face's switches (``activation_checkpointing_enable``, and ``gradient_checkpointing_enable``,
    # its older name), which ``Trainer`` flips at ``train()`` under ``TrainingArguments(activation_checkpointing=True)``:
    # the compiled graph is fixed, so each holds where the plan already does as asked, and raises naming the fix
    # where it does not (``_fixed_checkpointing``).

    def activation_checkpointing_enable(self, *args: Any, **kwargs: Any) -> None:
        _fixed_checkpointing(self, "activation_checkpointing_enable", True)

    def gradient_checkpointing_enable(self, *args: Any, **kwargs: Any) -> None:
        _fixed_checkpointing(self, "gradient_checkpointing_enable", True)

    def activation_checkpointing_disable(self) -> None:
        _fixed_checkpointing(self, "activation_checkpointing_disable", False)

    def gradient_checkpointing_disable(self) -> None:
        _fixed_checkpointing(self, "gradient_checkpointing_disable", False)


def _fixed_checkpointing(view: DistributedModel, method: str, enable: bool) -> None:
    """``method`` of the model on a compiled module: nothing to do where the plan already
    recomputes layers (``enable``) or none (not), else ConfigError naming how to compile it so."""
    model_class = type(view).__bases__[-1]
    if not hasattr(model_class, method):
        raise AttributeError(f"'{model_class.__name__}' object has no attribute {method!r}")
    plan = view._autopar_owner.plan
    recomputed = [segment.name for segment in plan.memory.checkpoint] if plan.memory is not None else []
    if bool(recomputed) == enable:
        return
    if enable:
        fix = (
            "compile with checkpointing='full' (every layer recomputed, as this switch asks), or call "
            f"{method}() on the model before autopar.compile, which plans the model's own checkpointing so"
        )
    else:
        fix = f"compile with checkpointing=False (the plan recomputes {', '.join(recomputed[:3])}{' ...' if len(recomputed) > 3 else ''})"
    raise ConfigError(
        f"{method}() cannot change a compiled module: its graph and plan are fixed at autopar.compile. To {'recompute' if enable else 'keep'} activations, {fix}"
    )


class ModelAttributes:
    """Mixed into the compiled modules (``ParallelModule``, ``PipelineParallelModule``): what the
    module is not, the model is. ``pm.config``, ``pm.generate(...)``, ``pm.transformer`` come from
    ``pm.module`` (the view), where calling the model runs the compiled module."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # type: ignore[misc]  # nn.Module's: parameters, buffers, submodules
        except AttributeError:
            view = self.__dict__.get("_modules", {}).get("module")
            if view is None or name.startswith("__"):
                raise
        try:
            return getattr(view, name)
        except AttributeError:
            raise AttributeError(
                f"'{type(self).__name__}' object has no attribute {name!r}, and neither has the model "
                f"({type(view).__bases__[-1].__name__})"
            ) from None


def distributed_class(cls: type) -> type:
    """The dynamic subclass ``Distributed<cls>`` of ``cls`` (one per class, as FSDP2's)."""
    made = _CLASSES.get(cls)
    if made is None:
        made = _CLASSES[cls] = type(f"Distributed{cls.__name__}", (DistributedModel, cls), {"__module__": cls.__module__})
    return made


def model_view(model: torch.nn.Module, owner: torch.nn.Module) -> torch.nn.Module:
    """A shell of ``model`` whose root calls ``owner`` (its tensors left out: ``attach`` fills them)."""
    root = _shell(model, {}, distributed_class(type(model)))
    root.__dict__["_autopar_owner"] = owner
    return root


def _shell(module: torch.nn.Module, memo: dict[int, torch.nn.Module], cls: type | None = None) -> torch.nn.Module:
    """``module``'s class and attributes without its parameters and buffers; a submodule shared
    by two paths stays one shell."""
    if id(module) in memo:
        return memo[id(module)]
    shell = object.__new__(cls or type(module))
    memo[id(module)] = shell
    shell.__dict__.update(module.__dict__)
    # a None entry (Linear(bias=False)'s bias) is the model's attribute too, and holds no tensor
    shell.__dict__["_parameters"] = {name: None for name, value in module._parameters.items() if value is None}
    shell.__dict__["_buffers"] = {name: None for name, value in module._buffers.items() if value is None}
    shell.__dict__["_non_persistent_buffers_set"] = set(module._non_persistent_buffers_set)
    if _SAVED_HOOKS not in module.__dict__:  # a module of the user's model, not a shell already
        shell.__dict__[_SAVED_HOOKS] = {
            name: OrderedDict(module.__dict__[name]) for name in _HOOK_DICTS if module.__dict__.get(name)
        }
    for name in _HOOK_DICTS:
        if name in module.__dict__:  # plain tables (the view's may be runtime.hook_guard's guarded ones)
            shell.__dict__[name] = OrderedDict()
    shell.__dict__["_modules"] = {name: None if child is None else _shell(child, memo) for name, child in module._modules.items()}
    return shell


def local_model(view: torch.nn.Module, tensors: Mapping[str, tuple[torch.Tensor, str]]) -> torch.nn.Module:
    """A plain model of ``view``'s classes (the root's too) over ``tensors`` (FQN → (this rank's
    tensor, "param" or "buffer")), sharing their storage: where the plan replicates every tensor,
    the model itself, run eagerly with no communication (``ParallelModule``'s local evaluation)."""
    root = _shell(view, {}, type(view).__bases__[-1])
    root.__dict__.pop("_autopar_owner", None)
    for module in root.modules():  # the model's own hooks run, as in eager
        for name, table in module.__dict__[_SAVED_HOOKS].items():
            module.__dict__[name] = OrderedDict(table)
    for fqn, (tensor, kind) in tensors.items():
        *path, leaf = fqn.split(".")
        module = root
        for part in path:
            module = module._modules[part]
        if kind == "param":
            module._parameters[leaf] = tensor if isinstance(tensor, torch.nn.Parameter) else torch.nn.Parameter(tensor, False)
        else:
            module._buffers[leaf] = tensor
    return root
