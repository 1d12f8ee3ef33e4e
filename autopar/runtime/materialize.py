"""Models built on the meta device: trace them, and give each rank only its own shards.

A model built under ``with torch.device("meta"):`` has shapes but no values, so it costs no
memory. ``autopar.compile`` traces it with FakeTensors on the real device (``autopar.trace.fake.fake_tensors``),
which gives the same graph, graph hash and plan as the same model built on that device.
Each rank then materializes only its own shards, in one of two ways (``compile(init=...)``):

``SeededInit(seed, fn=None)``
    Re-runs the modules' own initialization, seeded, one module at a time. Modules are visited
    in the order ``model.apply`` visits them (children first, then the parent). For each one its
    own parameters and buffers (not its children's) are allocated whole on ``device`` and filled
    with NaN; then its ``reset_parameters()`` runs if it has one, then ``fn(module)`` if given
    (e.g. a Hugging Face or GPT ``_init_weights``); then each rank keeps only its shard of each
    tensor and drops the whole one. The random stream is seeded once, with ``seed``, in a forked
    RNG state (the caller's global RNG is left alone).

    *Deterministic contract:* every rank gets exactly its shard of the tensors that
    ``SeededInit(seed, fn).apply(model)`` gives on an ordinary (CPU) copy of the same model, the
    same numbers on any mesh and under any plan. That is *not* the constructor's init: a model's
    ``__init__`` draws random numbers in its own order, which cannot be replayed module by
    module. Call ``SeededInit(...).apply(model)`` on the unsharded model to get the reference.

    *Memory:* at most one module's own tensors are held whole at once (one ``nn.Linear`` weight
    and bias, say), plus this rank's shards. A tensor shared by several modules (a tied
    embedding and LM head) stays whole until its last owner has been initialized, as ``apply``
    would have re-initialized it there.

    *Requirements:* ``reset_parameters`` and ``fn`` initialize only the module's own tensors
    (``recurse=False``), as torch's built-in modules do; a tensor left NaN afterwards is an error
    naming it (a parameter of a custom module without ``reset_parameters``: pass ``fn``).
    Integer buffers are not checked.

``FromCheckpoint(path, unsaved=None)``
    Allocates each rank's shards empty and reads them from a checkpoint written by
    ``autopar.checkpoint.save`` (any mesh, any plan). Holds only this rank's shards. A checkpoint
    holds the model's ``state_dict()``, which leaves out non-persistent buffers (a Hugging Face
    model's RoPE ``inv_freq``): ``unsaved=SeededInit(...)`` makes those, as it would; without it,
    a model that reads such a buffer is refused, naming it (its values would be uninitialized).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from autopar.errors import ConfigTypeError, ModelError
from autopar.ir.spec import Spec, local_shape, piece_shape, shard_tensor
from autopar.trace.fake import apply_order, fake_tensors, has_meta_tensors, own_tensors

__all__ = [
    "SeededInit",
    "FromCheckpoint",
    "has_meta_tensors",
    "fake_tensors",
    "seeded_shards",
    "empty_shards",
    "checkpoint_shards",
]


@dataclass(frozen=True, slots=True)
class SeededInit:
    """Initialize each rank's shards by the modules' own init, seeded (see the module docstring)."""

    seed: int = 0
    fn: Callable[[torch.nn.Module], None] | None = None
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not isinstance(self.seed, int):
            raise ConfigTypeError(f"SeededInit.seed must be an int, got {self.seed!r}")
        if self.fn is not None and not callable(self.fn):
            raise ConfigTypeError(f"SeededInit.fn must be a function of one module, got {self.fn!r}")

    def init_module(self, module: torch.nn.Module) -> None:
        """Initialize ``module``'s own tensors: ``reset_parameters()``, then ``fn``."""
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
        if self.fn is not None:
            self.fn(module)

    @torch.no_grad()
    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        """The reference: initialize an ordinary (unsharded) ``model`` in place, as the shards are."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            for _, module in apply_order(model):
                self.init_module(module)
        return model


@dataclass(frozen=True, slots=True)
class FromCheckpoint:
    """Read each rank's shards from an ``autopar.checkpoint.save`` directory."""

    path: str | os.PathLike
    device: str = "cpu"
    unsaved: SeededInit | None = None  # makes the tensors a checkpoint does not hold (non-persistent buffers)

    def __post_init__(self) -> None:
        if self.unsaved is not None and not isinstance(self.unsaved, SeededInit):
            raise ConfigTypeError(f"FromCheckpoint.unsaved must be an autopar.SeededInit, got {self.unsaved!r}")


def empty_shards(
    model: torch.nn.Module,
    specs: Mapping[str, Spec],
    mesh_shape: tuple[int, ...],
    device: str | torch.device = "cpu",
    coordinate: tuple[int, ...] | None = None,
) -> dict[str, torch.Tensor]:
    """FQN → an uninitialized tensor of the shard shape of the rank at ``coordinate`` (its own
    piece of a padded shard, ``ir.spec.piece_shape``; None: the padded shape), for every tensor
    in ``specs``."""
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    return {
        fqn: torch.empty(
            _shard_shape(tuple(named[fqn].shape), spec, mesh_shape, coordinate), dtype=named[fqn].dtype, device=device
        )
        for fqn, spec in specs.items()
        if fqn in named
    }


def _shard_shape(
    shape: tuple[int, ...], spec: Spec, mesh_shape: tuple[int, ...], coordinate: tuple[int, ...] | None
) -> tuple[int, ...]:
    return local_shape(shape, spec, mesh_shape) if coordinate is None else piece_shape(shape, spec, coordinate, mesh_shape)


def checkpoint_shards(
    model: torch.nn.Module,
    init: FromCheckpoint,
    specs: Mapping[str, Spec],
    coordinate: tuple[int, ...],
    mesh_shape: tuple[int, ...],
) -> dict[str, torch.Tensor]:
    """FQN → this rank's shard of each tensor in ``specs``, for ``autopar.checkpoint.load`` to fill:
    empty, except the tensors no checkpoint holds (non-persistent buffers), made by ``init.unsaved``."""
    shards = empty_shards(model, specs, mesh_shape, init.device, coordinate)
    saved = set(model.state_dict(keep_vars=True))
    unsaved = {fqn: spec for fqn, spec in specs.items() if fqn not in saved}
    if unsaved and init.unsaved is None:
        names = ", ".join(sorted(unsaved)[:4]) + (f" and {len(unsaved) - 4} more" if len(unsaved) > 4 else "")
        raise ModelError(
            f"{type(model).__name__} reads buffers that no checkpoint holds (non-persistent: {names}), so "
            "FromCheckpoint would leave them uninitialized: pass FromCheckpoint(path, unsaved=autopar.SeededInit(seed, "
            "fn=...)) to make them as that init does (for a Hugging Face model, fn=model._init_weights)"
        )
    if unsaved:
        shards.update(seeded_shards(model, init.unsaved, unsaved, coordinate, mesh_shape))
    return shards


@torch.no_grad()
def seeded_shards(
    model: torch.nn.Module, init: SeededInit, specs: Mapping[str, Spec], coordinate: tuple[int, ...], mesh_shape: tuple[int, ...]
) -> dict[str, torch.Tensor]:
    """FQN → this rank's shard of each tensor in ``specs``, as ``init.apply`` would make it whole.

    ``model`` is left as it was (its tensors are swapped back after each module).
    """

    order = list(apply_order(model))
    owners_left: dict[int, int] = {}
    for _, module in order:
        for _, _, tensor in own_tensors(module):
            owners_left[id(tensor)] = owners_left.get(id(tensor), 0) + 1
    whole: dict[int, torch.Tensor] = {}
    names: dict[int, list[str]] = {}
    shards: dict[str, torch.Tensor] = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(init.seed)
        for prefix, module in order:
            own = list(own_tensors(module))
            for slot, name, tensor in own:
                key = id(tensor)
                names.setdefault(key, []).append(prefix + name)
                if key not in whole:
                    whole[key] = _blank(tensor, init.device)
                getattr(module, slot)[name] = whole[key]
            try:
                init.init_module(module)
            finally:
                for slot, name, tensor in own:
                    getattr(module, slot)[name] = tensor
            for _, _, tensor in own:
                key = id(tensor)
                owners_left[key] -= 1
                if owners_left[key]:
                    continue
                full = whole.pop(key)
                fqns = names.pop(key)
                if full.is_floating_point() and bool(torch.isnan(full).any()):
                    raise ModelError(
                        f"{fqns[0]} ({type(module).__name__}) holds values no initializer set: neither the "
                        "module's reset_parameters() nor SeededInit.fn initialized all of it. Pass "
                        "SeededInit(seed, fn=...) with a function that initializes it, or load a "
                        "checkpoint with FromCheckpoint(path)"
                    )
                for fqn in fqns:
                    if fqn in specs:
                        local = shard_tensor(full, specs[fqn], coordinate, mesh_shape).clone()
                        for alias in fqns:
                            shards[alias] = local
                        break
    return shards


def _blank(tensor: torch.Tensor, device: str | torch.device) -> torch.Tensor:
    """A whole tensor like ``tensor`` on ``device``, NaN where floating (so gaps are found)."""
    fill = float("nan") if tensor.dtype.is_floating_point else 0
    blank = torch.full(tensor.shape, fill, dtype=tensor.dtype, device=device)
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(blank, requires_grad=tensor.requires_grad)
    return blank
