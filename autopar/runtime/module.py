"""ParallelModule: the compiled model, an nn.Module over this rank's shards."""

from __future__ import annotations

import datetime
import logging
import math
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.fx
import torch.utils._pytree as pytree
from torch.distributed.tensor import Shard

from autopar.passes.schedule import bind_parameters
from autopar.ops import collectives
from autopar.ir.plan import Plan
from autopar.ir.spec import Spec, is_strided, shard_tensor
from autopar.trace import TracedModel
from autopar.runtime.offload import param_key
from autopar.runtime.checkpoint import device_mesh
from autopar.runtime.checkpoint import model_state_dict
from autopar.runtime.checkpoint import load_model_state_dict

log = logging.getLogger("autopar")


def gather_tensor(local: torch.Tensor, spec: Spec, groups: tuple[str, ...]) -> torch.Tensor:
    """The whole tensor from every rank's shard (no autograd)."""
    full = local.detach()
    for axis in reversed(range(len(spec))):
        placement = spec[axis]
        if is_strided(placement):
            full = collectives.no_grad_all_gather(full, placement.dim, groups[axis], placement.split_factor)
        elif isinstance(placement, Shard):
            full = collectives.no_grad_all_gather(full, placement.dim, groups[axis])
    return full


class _Holder(torch.nn.Module):
    """An empty module used to rebuild the model's module tree for parameter names."""


class ParallelModule(torch.nn.Module):
    """Runs the rewritten graph on this rank's shards.

    Called like the original model with whole inputs (the same on every rank); returns the
    model's outputs, whole on every rank. ``pm.module`` holds the local shards under the
    model's own names, so ``pm.parameters()`` is what an optimizer steps (like DDP, names carry
    the ``module.`` prefix; ``full_state_dict`` uses the original names). ``state_dict()``
    shows the shards as DTensors under the original names, for torch.distributed.checkpoint
    (``autopar.runtime.checkpoint``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        traced: TracedModel,
        gm: torch.fx.GraphModule,
        plan: Plan,
        groups: tuple[str, ...],
        coordinate: tuple[int, ...],
        local_shards: Mapping[str, torch.Tensor] | None = None,
        offloader: Any = None,
    ):
        """``local_shards`` (FQN → this rank's shard) replaces cutting the model's own tensors:
        ``compile`` passes it for models on the meta device (``autopar.runtime.materialize``).
        ``offloader`` (``autopar.runtime.offload.Offloader``) holds the parameters, gradients and
        optimizer state the plan offloads: an offloaded parameter's shard goes to its store, and
        the module holds an empty stub in its place (step with ``autopar.optim.AdamW``)."""
        super().__init__()
        self._plan = plan
        self._traced = traced
        self._groups = groups
        self._coordinate = coordinate
        self._device_mesh: Any = None
        self.graph_module = gm
        self.module = _Holder()
        full = dict(model.named_parameters(remove_duplicate=False))
        full.update(dict(model.named_buffers(remove_duplicate=False)))
        self._full_shapes = {fqn: tuple(t.shape) for fqn, t in full.items()}
        made: dict[str, torch.Tensor] = {}
        for graph_input in traced.inputs:
            if graph_input.kind not in ("param", "buffer"):
                continue
            fqn = graph_input.fqn
            canonical = traced.ties.get(fqn, fqn)
            if canonical in made:
                _attach(self.module, fqn, made[canonical], graph_input.kind)
                continue
            spec = plan.params[fqn]
            offloaded = offloader is not None and graph_input.kind == "param" and canonical in offloader.params
            if local_shards is not None:
                local = local_shards[fqn]
            elif offloaded:  # no resident copy: straight from the model's tensor to the store
                local = shard_tensor(full[fqn].detach(), spec, coordinate, plan.mesh_shape)
            else:
                local = shard_tensor(full[fqn].detach(), spec, coordinate, plan.mesh_shape).clone()
            if offloaded:
                offloader.store.put(param_key(canonical), local)
                local = torch.empty(0, dtype=local.dtype, device=local.device)
            if graph_input.kind == "param":
                value: torch.Tensor = torch.nn.Parameter(local, requires_grad=full[fqn].requires_grad)
            else:
                value = local
            made[canonical] = value
            made[fqn] = value
            _attach(self.module, fqn, value, graph_input.kind)
        self._offloader = offloader
        if offloader is not None:
            offloader.attach_grad_hooks({traced.ties.get(fqn, fqn): p for fqn, p in made.items() if isinstance(p, torch.nn.Parameter)})
        self._inputs = [(gi.name, gi.kind, gi.fqn) for gi in traced.inputs]
        # The communication schedule's buckets and gathers read and write these shards.
        bind_parameters(gm, {name: _lookup(self.module, fqn) for name, kind, fqn in self._inputs if kind == "param"})
        # The original state_dict()'s names, in its order: tied names, no non-persistent buffers.
        self._state_keys = [k for k in model.state_dict(keep_vars=True) if _has(self.module, k) or k in traced.ties]
        self._constants = dict(traced.constants)
        placeholders = {n.name: n for n in traced.gm.graph.nodes if n.op == "placeholder"}
        self._user_metas = [
            (gi.name, tuple(placeholders[gi.name].meta["val"].shape), placeholders[gi.name].meta["val"].dtype)
            if isinstance(placeholders[gi.name].meta.get("val"), torch.Tensor) else (gi.name, None, None)
            for gi in traced.inputs if gi.kind == "user"
        ]

    @property
    def plan(self) -> Plan:
        return self._plan

    @property
    def graph(self) -> torch.fx.Graph:
        return self.graph_module.graph

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        flat = _flatten_inputs(args, kwargs, self._traced.in_spec)
        self._check_inputs(flat)
        user = iter(flat)
        values = []
        for name, kind, fqn in self._inputs:
            if kind in ("param", "buffer"):
                values.append(_lookup(self.module, fqn))
            elif kind == "constant":
                values.append(self._constants[name])
            else:
                values.append(next(user))
        if self._offloader is not None:
            with self._offloader.saved_tensor_hooks():
                outputs = self.graph_module(*values)
        else:
            outputs = self.graph_module(*values)
        return pytree.tree_unflatten(list(outputs), self._traced.out_spec)

    def _check_inputs(self, flat: list[Any]) -> None:
        for value, (name, shape, dtype) in zip(flat, self._user_metas):
            if shape is None or not isinstance(value, torch.Tensor):
                continue
            if tuple(value.shape) != shape or value.dtype != dtype:
                raise ValueError(
                    f"input {name!r} has shape {tuple(value.shape)} and dtype {value.dtype}, but this module "
                    f"was planned for shape {shape} and dtype {dtype} (its example inputs). Pass inputs of the "
                    "planned shape, or compile again with example inputs of the new shape"
                )

    def _fqns(self) -> list[tuple[str, str]]:
        names = [(fqn, kind) for _, kind, fqn in self._inputs if kind in ("param", "buffer")]
        seen = {fqn for fqn, _ in names}
        names += [(fqn, "param") for fqn in self._traced.ties if fqn not in seen]
        return names

    @property
    def offloader(self) -> Any:
        """The ``autopar.runtime.offload.Offloader`` of a plan that offloads, else None."""
        return self._offloader

    def _local(self, fqn: str) -> torch.Tensor:
        """This rank's shard under ``fqn``, or under its tie's first name if only that one is held
        (read from the offload store where the plan offloads it)."""
        canonical = self._traced.ties.get(fqn, fqn)
        if self._offloader is not None and canonical in self._offloader.params:
            return self._offloader.store.get(param_key(canonical))
        return _lookup(self.module, fqn if _has(self.module, fqn) else canonical)

    def _grad(self, fqn: str) -> torch.Tensor | None:
        canonical = self._traced.ties.get(fqn, fqn)
        if self._offloader is not None and canonical in self._offloader.grads:
            return self._offloader.grad(canonical)
        return self._local(fqn).grad

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The original model's ``state_dict()``, gathered whole on every rank.

        Same names (tied names both present, sharing one tensor, as in the model's own state
        dict; non-persistent buffers left out), so ``model.load_state_dict(pm.full_state_dict())``
        loads into the unsharded model.
        """
        out: dict[str, torch.Tensor] = {}
        gathered: dict[int, torch.Tensor] = {}
        held = []  # an offloaded shard is a fresh tensor: keep it, so that its id is not reused
        for fqn in self._state_keys:
            local = self._local(fqn)
            held.append(local)
            if id(local) not in gathered:
                gathered[id(local)] = gather_tensor(local, self._plan.params[fqn], self._groups)
            out[fqn] = gathered[id(local)]
        return out

    # -- torch.distributed.checkpoint (autopar/runtime/checkpoint.py) ----------------------------------

    @property
    def coordinate(self) -> tuple[int, ...]:
        """This rank's position on the mesh."""
        return self._coordinate

    @property
    def device_mesh(self) -> Any:
        """A ``DeviceMesh`` over autopar's mesh-axis process groups (made on first use)."""
        if self._device_mesh is None:
            self._device_mesh = device_mesh(self._plan.mesh_shape, self._groups)
        return self._device_mesh

    def state_dict_keys(self) -> list[str]:
        """The names of ``state_dict()``: those of the original model's ``state_dict()``."""
        return list(self._state_keys)

    def full_shape(self, fqn: str) -> tuple[int, ...]:
        """The whole (unsharded) shape of the parameter or buffer ``fqn``."""
        return self._full_shapes[fqn]

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> dict[str, Any]:
        """The original model's ``state_dict()`` names, each a DTensor over ``device_mesh``
        with the plan's placements that shares this rank's shard (no copy). For
        ``torch.distributed.checkpoint``: ``dcp.save(pm.state_dict(), checkpoint_id=path)``;
        ``sd = pm.state_dict(); dcp.load(sd, checkpoint_id=path)`` reads into the shards."""
        out = model_state_dict(self)
        if destination is None:
            return out if not prefix else {prefix + k: v for k, v in out.items()}
        for key, value in out.items():
            destination[prefix + key] = value
        return destination

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Copy whole tensors (a plain ``state_dict()``) or DTensors on ``device_mesh`` (a filled
        ``pm.state_dict()``) into this rank's shards."""
        if assign:
            raise ValueError("ParallelModule.load_state_dict copies into its shards; assign=True is not supported")
        missing, unexpected = load_model_state_dict(self, state_dict, strict=strict)
        return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)

    @torch.no_grad()
    def full_grads(self) -> dict[str, torch.Tensor | None]:
        """Every parameter's gradient, gathered whole, under the model's original names."""
        out: dict[str, torch.Tensor | None] = {}
        for fqn, kind in self._fqns():
            if kind != "param":
                continue
            grad = self._grad(fqn)
            out[fqn] = None if grad is None else gather_tensor(grad, self._plan.params[fqn], self._groups)
        return out

    def local_param_bytes(self) -> int:
        """Bytes of parameters this rank holds (each shared tensor counted once)."""
        return sum(p.numel() * p.element_size() for p in self.parameters())


def _flatten_inputs(args, kwargs, in_spec) -> list[Any]:
    flat, spec = pytree.tree_flatten((args, kwargs))
    if spec != in_spec:
        raise ValueError(
            "ParallelModule was called with a different argument structure than the example inputs "
            f"it was compiled with.\n  expected: {in_spec}\n  got:      {spec}"
        )
    return flat


def _attach(root: torch.nn.Module, fqn: str, value: torch.Tensor, kind: str) -> None:
    *path, leaf = fqn.split(".")
    module = root
    for part in path:
        if not hasattr(module, part) or part not in module._modules:
            module.add_module(part, _Holder())
        module = module._modules[part]
    if kind == "param":
        module.register_parameter(leaf, value)
    else:
        module.register_buffer(leaf, value)


def _lookup(root: torch.nn.Module, fqn: str) -> torch.Tensor:
    *path, leaf = fqn.split(".")
    module = root
    for part in path:
        module = module._modules[part]
    return getattr(module, leaf)


def _has(root: torch.nn.Module, fqn: str) -> bool:
    try:
        _lookup(root, fqn)
        return True
    except (KeyError, AttributeError):
        return False


def world_timeout() -> "datetime.timedelta | None":
    """The timeout the default process group was created with, or None if it cannot be read."""
    group = dist.distributed_c10d._get_default_group()
    device = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
    try:
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None


def mesh_groups(mesh_shape: tuple[int, ...]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """One process group per mesh axis; return their names and this rank's mesh coordinate.

    Rank r sits at the row-major position of r. The groups take the default group's timeout:
    groups made without one get torch's default (30 minutes on gloo), so a dead rank would stall
    its peers that long instead of failing them within the timeout the user chose.
    """
    ranks = torch.arange(math.prod(mesh_shape)).reshape(mesh_shape)
    timeout = world_timeout()
    if timeout is None:
        log.warning("autopar: could not read the default process group's timeout; mesh groups use torch's default")
    names = []
    for axis, size in enumerate(mesh_shape):
        members = ranks.movedim(axis, -1).reshape(-1, size).tolist()
        group, _ = dist.new_subgroups_by_enumeration(members, timeout=timeout)
        names.append(group.group_name)
    coordinate = tuple(int(i) for i in torch.unravel_index(torch.tensor(dist.get_rank()), mesh_shape))
    return tuple(names), coordinate
