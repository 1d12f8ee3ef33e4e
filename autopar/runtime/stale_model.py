"""The model passed to ``autopar.compile``, once the compiled module has trained.

Under DDP and FSDP2 the name a script wrapped is the trained model, so a script that evaluates,
generates from, averages or saves through it (``model.eval(); model(x)``, an EMA of ``model``,
``torch.save(model.state_dict())``) reads trained weights there. Where the plan holds a tensor
whole, in the model's dtype (data parallel, one device), ``pm`` holds the model's own tensor
(``_shared``; ``runtime.module`` shares it): the model is the trained one there, and the weights
are on the device once. A second ``compile`` of the same model copies them (``lent``), so that two
modules never train one tensor.

Where the plan cuts a tensor (or casts it), ``pm`` holds a shard of its own and the model's goes
stale: it would read the initial weights, without a word. So once ``pm`` has changed its own
tensors (an optimizer stepped them, or they were written in place: a loaded checkpoint) while the
model has not (no optimizer stepped it, nothing wrote its parameters), the model's ``state_dict()``
and a forward that does not train (grad mode off, or the model in eval mode) raise a
``UsageError`` that names ``pm.module``, the model distributed; and once a torch optimizer,
``autopar.optim`` or a load into ``pm`` has written ``pm``'s own shards, any other read of those
parameters' values (an EMA of the model, ``p.data``, a copy, another ``compile``) raises too
(``originals._Stale``, ``mark``). Once the model has changed, or ``pm`` is gone, the guard is
removed. autopar's own calls (``compile`` of the same model again: ``quiet``) pass.

A model that trains itself beside ``pm`` (its own forward in training, or a gradient of its own:
``runtime.originals``) gets storage of its own for what it shared (``unshare``), so that neither
trains the other's weights; if ``pm`` had written them already, a warning says that the model goes
on from the trained weights, not from those it had at ``compile`` (a reference from the same start
is a compiled copy, as under DDP).

Modes alike: under DDP, ``model.eval()`` or ``model.backbone.eval()`` on the name the script wrapped
switches the wrapped forward; here ``pm`` keeps its own modules' modes. So a call of ``pm`` while
the model's modes differ from ``pm``'s, changed since ``compile``, while the model stands for
``pm`` (sharing its tensors, or stale as above), raises a ``UsageError`` naming ``pm.eval()``
(``check_modes``).

A ``load_state_dict`` into the model or one of its modules (a resume through the pre-wrap name)
is copied into ``pm``'s shards as well (``_Loaded``), since under DDP it would load the trained
model; the two are equal again after it. Gradients and freezing through the model's parameters
are ``runtime.originals``'.

What moved is seen two ways: a global optimizer step post-hook (fused optimizers write without
bumping a tensor's version) and, for the rest, the sum of the tensors' version counters (a
DTensor's in-place ops bump the wrapper's, a load into its shard the local tensor's).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import operator
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from autopar.errors import UsageError
from autopar.ops.params import local_of
from autopar.runtime import originals
from autopar.runtime.checkpoint import copy_into_shard
from autopar.runtime.pickling import InertHook

# id(parameter) → (the parameter, a watch it belongs to, "pm" or "model") for each watch; weak on both
_PARAMS: dict[int, list[tuple[weakref.ref, weakref.ref, str]]] = {}
# id(model tensor) → (it, the watch whose pm holds it as it is: ``_shared``)
_LENT: dict[int, tuple[weakref.ref, weakref.ref]] = {}
_SEEN: weakref.WeakKeyDictionary[Any, tuple[int, int]] = weakref.WeakKeyDictionary()  # optimizer → (params, generation)
_STATE = {"generation": 0, "quiet": 0}
_HOOK: list[Any] = []
_TRAINING = operator.attrgetter("training")
log = logging.getLogger("autopar")


class _Watch:
    """One compiled module and the model it was compiled from."""

    def __init__(self, model: torch.nn.Module, pm: torch.nn.Module):
        self.model = weakref.ref(model)
        self.pm = weakref.ref(pm, lambda _: self.forget())
        self.shared = _shared(model, pm)
        self.shared_ids = {id(entry[0]()) for entry in self.shared}
        self.shared_addresses = {address for _, _, address in self.shared}
        self.pm_own = any(not self._pm_shares(p) for p in pm.parameters())  # pm holds weights of its own
        self.cut = [weakref.ref(p) for p in model.parameters() if id(p) not in self.shared_ids]  # pm's own shards
        self.rebase(model, pm)
        self.model_stepped = False
        self.called = False  # pm has been called (``check_modes``)
        # each module of the model (weakly: pm must not keep the model's weights alive), its name and mode
        named = list(model.named_modules())
        self.names = [name for name, _ in named]
        self.model_modules = [weakref.proxy(module) for _, module in named]
        self.model_modes = tuple(map(_TRAINING, self.model_modules))
        me = weakref.ref(self)
        for param in model.parameters():  # a model compiled twice is in two watches
            if id(param) not in self.shared_ids:
                _PARAMS.setdefault(id(param), []).append((weakref.ref(param), me, "model"))
        for param in pm.parameters():
            side = "shared" if self._pm_shares(param) else "pm"
            _PARAMS.setdefault(id(param), []).append((weakref.ref(param), me, side))
        for entry in self.shared:
            _LENT[id(entry[0]())] = (entry[0], me)  # shared_ids are these keys
        originals.on_trains_itself(model, self.unshare)
        self.handles = [
            model.register_forward_pre_hook(_Guard(self, "forward")),
            model.register_state_dict_pre_hook(_Guard(self, "state_dict")),
        ]
        held = set(pm.local_state_keys())
        for prefix, module in named:
            names = [name for name in (*module._parameters, *module._buffers) if _dotted(prefix, name) in held]
            if names:
                self.handles.append(module.register_load_state_dict_post_hook(_Loaded(self, module, prefix, names)))

    def rebase(self, model: torch.nn.Module, pm: torch.nn.Module) -> None:
        """The model and ``pm`` are equal as they are now (at ``compile``, after a mirrored load)."""
        self.model_versions = _versions(p for p in model.parameters() if id(p) not in self.shared_ids)
        self.pm_versions = self._pm_versions(pm)
        self.shared_versions = self._shared_versions()
        self.pm_stepped = self.shared_stepped = False
        _STATE["generation"] += 1  # every optimizer is looked at again (``_stepped``)
        self.mark(False)

    def mark(self, stale: bool) -> None:
        """Reading the values of the model's parameters that ``pm`` holds shards of raises
        (``stale``: ``pm`` trained past them) or passes again (``originals.mark_stale``)."""
        originals.mark_stale([param for ref in self.cut if (param := ref()) is not None], stale)

    def _pm_versions(self, pm: torch.nn.Module) -> int:
        """The version counters of ``pm``'s own parameters: a DTensor's (its in-place ops bump the
        wrapper's) and its local tensor's (which a checkpoint load writes)."""
        own = [p for p in pm.parameters() if not self._pm_shares(p)]
        return _versions(own) + _versions(local_of(p) for p in own if local_of(p) is not p)

    def _shared_versions(self) -> int:
        return _versions(tensor for entry in self.shared if (tensor := entry[0]()) is not None)

    def _pm_shares(self, param: torch.Tensor) -> bool:
        return local_of(param).data_ptr() in self.shared_addresses

    def __deepcopy__(self, memo: dict) -> None:
        return None  # a copy of pm (swa_utils.AveragedModel) guards nothing

    def remove(self) -> None:
        self.mark(False)
        for handle in self.handles:
            handle.remove()
        self.handles = []
        for key, entries in list(_PARAMS.items()):
            entries[:] = [entry for entry in entries if entry[1]() not in (self, None)]
            if not entries:
                del _PARAMS[key]

    def forget(self) -> None:
        """``pm`` is gone: nothing to guard, nothing lent."""
        self.remove()
        for key in self.shared_ids:
            if (lent := _LENT.get(key)) is not None and lent[1]() in (self, None):
                del _LENT[key]

    def sharing(self) -> bool:
        """Whether the model's tensors still are ``pm``'s, some of them (``_shared``)."""
        pm = self.pm()
        return pm is not None and any(_intact(pm, entry) for entry in self.shared)

    def unshare(self) -> None:
        """The model trains itself, beside ``pm``: its shared tensors get storage of their own, so
        that neither trains the other's weights. They start from ``pm``'s, as they are now."""
        pm = self.pm()
        intact = [entry for entry in self.shared if pm is not None and _intact(pm, entry)]
        if intact and (self.shared_stepped or self._shared_versions() != self.shared_versions):
            log.warning(
                "autopar: the model passed to autopar.compile trains itself now, beside the compiled module, which "
                "has changed them since: as under DDP they shared these weights (%d tensors), so the model goes on from "
                "pm's, not from the weights it had at compile. To train a reference from the same start, "
                "compile a copy: pm = autopar.compile(copy.deepcopy(model), ...)",
                len(intact),
            )
        with torch.no_grad(), originals.own_reads():
            for entry in intact:
                tensor = entry[0]()
                tensor.data = tensor.detach().clone()
        self.mark(False)  # its own from now on

    def stale(self) -> bool:
        """Whether ``pm`` has changed since ``compile`` and the model has not (else the guard goes):
        its own tensors were written, or one they shared was replaced on ``pm``'s side."""
        model, pm = self.model(), self.pm()
        moved = [] if pm is None else [entry for entry in self.shared if not _intact(pm, entry)]
        model_moved = any(entry[0]() is None or entry[0]().data_ptr() != entry[2] for entry in moved)
        if (
            model is None
            or pm is None
            or self.model_stepped
            or model_moved
            or _versions(p for p in model.parameters() if id(p) not in self.shared_ids) != self.model_versions
        ):
            self.remove()
            return False
        return bool(moved) or self.pm_stepped or self._pm_versions(pm) != self.pm_versions


def _shared(model: torch.nn.Module, pm: Any) -> list[tuple[weakref.ref, str, int]]:
    """The model's parameters and buffers that ``pm`` holds as they are, sharing their storage (the
    plan replicates them, in the model's dtype, as DDP does): each with its name and storage's address."""
    out, seen = [], set()
    for fqn, tensor in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
        if id(tensor) in seen or not tensor.numel() or tensor.is_meta:
            continue
        try:
            local = pm.local_shard(fqn)
        except (AttributeError, KeyError):
            continue
        if same_tensor(local, tensor):
            seen.add(id(tensor))
            out.append((weakref.ref(tensor), fqn, tensor.data_ptr()))
    return out


def same_tensor(local: torch.Tensor, whole: torch.Tensor) -> bool:
    """Whether ``local`` is ``whole`` itself (its storage, from its start, of its shape), not a
    piece or a copy of it: what ``pm`` holds as the model's own (``runtime.module`` shares these)."""
    return local.data_ptr() == whole.data_ptr() and local.shape == whole.shape and local.device == whole.device


def _intact(pm: Any, entry: tuple) -> bool:
    ref, fqn, address = entry
    tensor = ref()
    return tensor is not None and tensor.data_ptr() == address and pm.local_shard(fqn).data_ptr() == address


class _Loaded:
    """A model module's ``load_state_dict`` post-hook: what it loaded goes into ``pm``'s shards too,
    as under DDP, where the model's tensors are the trained ones (a resume through the pre-wrap name,
    of the whole model or of a module). Then the two are equal again. ``pm.module``'s shells share
    the model modules' hook tables, so the module is checked."""

    def __init__(self, watch: _Watch, module: torch.nn.Module, prefix: str, names: list[str]):
        self.watch, self.module, self.prefix, self.names = watch, weakref.ref(module), prefix, names

    def __reduce__(self) -> tuple[Any, tuple]:
        return InertHook, ()  # a copy or pickle of the model mirrors nothing

    def __call__(self, module: torch.nn.Module, incompatible: Any) -> None:
        watched = self.watch
        model, pm = watched.model(), watched.pm()
        if _STATE["quiet"] or module is not self.module() or model is None or pm is None or originals.trained_itself(model):
            return
        with torch.no_grad(), originals.own_reads():
            for name in self.names:
                tensor = module._parameters.get(name)
                tensor = module._buffers.get(name) if tensor is None else tensor
                if tensor is not None:
                    copy_into_shard(pm, _dotted(self.prefix, name), tensor.detach())
        watched.rebase(model, pm)


def _dotted(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class _Guard:
    """The model's forward pre-hook or state_dict pre-hook (a copy or pickle of the model gets none)."""

    autopar_guard = True  # not the model's own hook (trace.hooks)

    def __init__(self, watch: _Watch, call: str):
        self.watch = watch
        self.call = call

    def __reduce__(self) -> tuple[Any, tuple]:
        return InertHook, ()

    def __call__(self, module: torch.nn.Module, *args: Any) -> None:
        if _STATE["quiet"] or module is not self.watch.model() or torch.compiler.is_compiling():
            return
        if self.call == "forward" and torch.is_grad_enabled() and module.training:
            originals.trains_itself(module)  # the model trained eagerly, beside pm: its gradients are its own
            return
        if self.watch.stale():
            raise UsageError(_message(type(module).__name__, self.call))


def _message(name: str, call: str) -> str:
    what = "state_dict()" if call == "state_dict" else "forward (an evaluation or generation)"
    return (
        f"the {name} passed to autopar.compile is not the model that trains: the compiled module holds its own "
        f"copy of the weights and has trained since, so this {what} would read the weights from before training. "
        "Use the compiled module: pm.module is the model, distributed (pm.module(x), pm.module.generate(...), "
        "pm.module.state_dict() on every rank, then torch.save on rank 0), as DDP's model.module is; or load the "
        "trained weights back first: model.load_state_dict(pm.module.state_dict()). To keep the initial weights "
        "as a reference, compile a copy: pm = autopar.compile(copy.deepcopy(model), ...)"
    )


def watch(model: torch.nn.Module, pm: torch.nn.Module) -> None:
    """Guard ``model`` against being read for ``pm``'s weights (see the module docstring)."""
    if not _HOOK:
        _HOOK.append(register_optimizer_step_post_hook(_stepped))
    pm.__dict__["_autopar_stale_watch"] = _Watch(model, pm)  # lives as long as pm


def check_modes(pm: torch.nn.Module, modes: tuple[bool, ...]) -> None:
    """At a call of ``pm`` whose modules are in ``modes`` (``pm.module.named_modules()``'s order):
    refuse where the stale model's modes were changed since ``compile`` and are not ``pm``'s. At
    the first call, say what the model still holds on an accelerator (``_say_leftover``)."""
    watched = pm.__dict__.get("_autopar_stale_watch")
    if watched is not None and not watched.called:
        watched.called = True
        _say_leftover(watched)
    if watched is None or not watched.handles:
        return
    try:
        now = tuple(map(_TRAINING, watched.model_modules))
    except ReferenceError:  # the model is gone
        watched.remove()
        return
    if now == watched.model_modes or now == modes or not (watched.sharing() or watched.stale()):
        return
    differ = {name: mine for name, mine, theirs in zip(watched.names, now, modes) if mine != theirs}
    tops = [""] if "" in differ else [n for n in differ if not any(n.startswith(f"{other}.") for other in differ)]
    where = ", ".join(f"model{'.' if name else ''}{name}.{'train' if differ[name] else 'eval'}()" for name in tops[:3])
    raise UsageError(
        f"the model passed to autopar.compile was switched to another mode after compile ({where}), but the "
        "compiled module keeps its own modules' modes: unlike DDP's forward, pm does not follow the model's. Switch "
        "pm itself: pm.train() or pm.eval(), or a module's on pm.module (pm.module.backbone.eval()), which each "
        "call runs as eager does"
    )


def leftover_bytes(watched: _Watch) -> dict[torch.device, int]:
    """What the model passed to ``compile`` holds that ``pm`` does not (the whole tensors of those
    the plan cuts or casts; ``pm`` holds its own), in bytes by device, while the model lives."""
    model, held = watched.model(), {}
    if model is None:
        return held
    seen: set[int] = set(watched.shared_addresses)
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.is_meta or tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        held[tensor.device] = held.get(tensor.device, 0) + tensor.numel() * tensor.element_size()
    return held


def _accelerator(device: torch.device) -> bool:
    return device.type != "cpu"


def _say_leftover(watched: _Watch) -> None:
    """A model kept alive beside ``pm`` (``pm = autopar.compile(model, ...)`` with ``model`` still in
    scope) holds the whole tensors of what the plan cuts: on a GPU, memory that no plan counts."""
    held = {device: n for device, n in leftover_bytes(watched).items() if _accelerator(device)}
    if held:  # a model passed as a temporary may be held by export's reference cycles only
        gc.collect()
        held = {device: n for device, n in leftover_bytes(watched).items() if _accelerator(device)}
    if held:
        where = ", ".join(f"{_size(n)} on {device}" for device, n in held.items())
        log.warning(
            "autopar: the model passed to autopar.compile still holds %s that the compiled module does not use (the "
            "whole tensors of those the plan cuts or casts; pm holds its own), beyond the plan's memory: del model after "
            "compile frees it (or pass build() to compile, or start on the meta device with init=); to keep the model "
            "as a reference, move it: model.cpu()",
            where,
        )


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def stepped(pm: torch.nn.Module) -> None:
    """``pm``'s parameters were written where torch's step hook does not see it: by an optimizer that
    is not torch's (``autopar.optim.AdamW``), or a load into ``pm``."""
    watched = pm.__dict__.get("_autopar_stale_watch")
    if watched is not None:
        watched.pm_stepped = watched.pm_stepped or watched.pm_own
        watched.shared_stepped = watched.shared_stepped or bool(watched.shared)
        watched.mark(watched.pm_stepped)


def lent(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``, a model's, is held as it is by a live compiled module (``_shared``): a
    second ``compile`` of the model copies it instead, so that the two modules train apart."""
    entry = _LENT.get(id(tensor))
    watching = None if entry is None or entry[0]() is not tensor else entry[1]()
    pm = None if watching is None else watching.pm()
    if pm is None:
        _LENT.pop(id(tensor), None)
        return False
    return any(shared[0]() is tensor and _intact(pm, shared) for shared in watching.shared)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """autopar's own calls of a compiled model (``compile`` of it again) pass the guard."""
    _STATE["quiet"] += 1
    try:
        with originals.own_reads():  # its parameters' values too (``originals._Stale``)
            yield
    finally:
        _STATE["quiet"] -= 1


def _stepped(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Each torch optimizer is looked at once (again when its parameters or the watches change)."""
    if not _PARAMS:
        return
    num_params = sum(len(group["params"]) for group in optimizer.param_groups)
    seen = (num_params, _STATE["generation"])
    if _SEEN.get(optimizer) == seen:
        return
    _SEEN[optimizer] = seen
    for group in optimizer.param_groups:
        for param in group["params"]:
            for held, watched, side in _PARAMS.get(id(param), ()):
                if held() is param and (watching := watched()) is not None:
                    setattr(watching, f"{side}_stepped", True)
                    if side == "pm":
                        watching.mark(True)  # reading the model's values of these is refused from now on


def _versions(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t._version for t in tensors)


__all__ = ["watch", "check_modes", "stepped", "quiet", "lent", "same_tensor"]
