"""ShardedModule: what the single-stage and the pipelined runtime share.

Both hold this rank's shards of the model's parameters and buffers in ``self.module``, under the
model's own names, and both answer for the whole model: its ``state_dict()`` names, whole
shapes, gathered state and gradients. They differ in what one rank holds (every tensor, or only
its stage's) and in how a whole tensor is put together (a gather over the mesh, or a gather in
the stage that owns it and a broadcast to the others), which each subclass says through
``_contributes`` and ``_gather``.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
import torch.utils._pytree as pytree
from torch.distributed.tensor import Shard

from autopar.errors import ConfigTypeError, InputError
from autopar.ir.data import DataLayout
from autopar.ir.plan import Plan
from autopar.ir.spec import Spec, is_sharded, is_strided, pad_piece, shard_tensor
from autopar.ops import collectives
from autopar.ops.params import local_of
from autopar.runtime import originals
from autopar.runtime.checkpoint import device_mesh, model_state_dict
from autopar.runtime.data import GATHER, start_check
from autopar.runtime.offload import grad_key, param_key
from autopar.runtime.pickling import NotPickled
from autopar.runtime.trainer_saves import refuse_trainer_save
from autopar.trace import TracedModel, requires_grad
from autopar.trace.aliases import check_call_aliases, written_inputs

# A call's ``pytree.tree_flatten((args, kwargs))``: its leaves and their structure.
Flattened = tuple[list[Any], pytree.TreeSpec]

log = logging.getLogger("autopar")
_no_sync_said: list[bool] = []  # no_sync() logs what it does once per process


def gather_tensor(
    local: torch.Tensor, spec: Spec, groups: tuple[str, ...], full_shape: tuple[int, ...] | None = None
) -> torch.Tensor:
    """The whole tensor (of ``full_shape``, where a padded shard's pieces differ) from every
    rank's shard (no autograd)."""
    full = local.detach()
    for axis in reversed(range(len(spec))):
        placement = spec[axis]
        if is_strided(placement):
            full = collectives.no_grad_all_gather(full, placement.dim, groups[axis], placement.split_factor)
        elif isinstance(placement, Shard):
            full = _gather_padded(full, placement.dim, groups[axis], full_shape)
    return full


def _gather_padded(local: torch.Tensor, dim: int, group: str, full_shape: tuple[int, ...] | None) -> torch.Tensor:
    """``no_grad_all_gather`` of ``local`` along ``dim``; a padded shard's piece (``full_shape[dim]``
    not a multiple of the group size) is padded to ``ceil(n / k)`` rows first and the result cut to
    ``n``, as its scheduled gather does (``ops.buckets.ParamGathers``)."""
    k = collectives.group_size(group)
    if full_shape is None or full_shape[dim] % k == 0:
        return collectives.no_grad_all_gather(local, dim, group)
    whole = collectives.no_grad_all_gather(pad_piece(local, dim, -(-full_shape[dim] // k)), dim, group)
    return whole.narrow(dim, 0, full_shape[dim])


class Holder(torch.nn.Module):
    """An empty module used to rebuild the model's module tree for parameter names."""


def attach(root: torch.nn.Module, fqn: str, value: torch.Tensor, kind: str) -> None:
    """Register ``value`` under ``fqn`` in ``root``, making ``Holder``s for the missing parents."""
    *path, leaf = fqn.split(".")
    module = root
    for part in path:
        if not hasattr(module, part) or part not in module._modules:
            module.add_module(part, Holder())
        module = module._modules[part]
    if kind == "param":
        module.register_parameter(leaf, value)
    else:
        module.register_buffer(leaf, value)


def lookup(root: torch.nn.Module, fqn: str) -> torch.Tensor:
    *path, leaf = fqn.split(".")
    module = root
    for part in path:
        module = module._modules[part]
    return getattr(module, leaf)


def has(root: torch.nn.Module, fqn: str) -> bool:
    try:
        lookup(root, fqn)
        return True
    except (KeyError, AttributeError):
        return False


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers by FQN, tied names each present."""
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(dict(model.named_buffers(remove_duplicate=False)))
    return tensors


def flatten_inputs(
    args: tuple, kwargs: dict, in_spec: pytree.TreeSpec, names: list[str], flattened: Flattened | None = None
) -> list[Any]:
    """The call's leaves in the traced order; ``names`` (the user inputs' names in that order) let
    a mismatch say which argument is missing or unexpected. ``flattened``: ``tree_flatten((args,
    kwargs))`` where the caller has it already (the forward reads the leaves first)."""
    flat, spec = pytree.tree_flatten((args, kwargs)) if flattened is None else flattened
    if spec != in_spec:
        raise InputError(
            "ParallelModule was called with other arguments than the example inputs it was compiled "
            f"with: {call_mismatch(args, kwargs, in_spec, names)}. Pass the arguments the way the "
            "example inputs were passed"
        )
    return flat


def spec_children(spec: pytree.TreeSpec) -> list[pytree.TreeSpec]:
    """A tree spec's children (``TreeSpec.children()`` from torch 2.10; ``children_specs`` before)."""
    return spec.children() if hasattr(spec, "children") else spec.children_specs


def call_mismatch(args, kwargs, in_spec, names: list[str]) -> str:
    """What differs between a call and the example inputs, by argument name (``names``: the user
    inputs' names in flattening order, which name the positional arguments that are tensors)."""
    args_spec, kwargs_spec = spec_children(in_spec)
    num_args = args_spec.num_children
    leaves = all(child.is_leaf() for child in spec_children(args_spec)) and len(names) >= num_args
    positional = list(names[:num_args]) if leaves else [f"#{i + 1}" for i in range(num_args)]
    expected_kwargs = list(kwargs_spec.context or [])
    problems = [f"missing argument {name!r}" for name in positional[len(args) :] if name not in kwargs]
    if len(args) > num_args:
        problems.append(f"{len(args)} positional arguments given, {num_args} expected")
    problems += [f"missing keyword argument {key!r}" for key in expected_kwargs if key not in kwargs]
    problems += [
        f"unexpected keyword argument {key!r}"
        for key in kwargs
        if key not in expected_kwargs and key not in positional[len(args) :]
    ]
    problems += [
        f"argument {key!r} passed by keyword, but the example inputs passed it by position"
        for key in kwargs
        if key in positional[len(args) :]
    ]
    if not problems:
        problems = ["the same arguments, nested differently (tuples, lists or dicts) than in the example inputs"]
    return "; ".join(problems)


class ShardedModule(NotPickled, torch.nn.Module):
    """This rank's shards of a traced model, cut by a plan on a mesh of ``mesh_shape``.

    A subclass fills ``self.module`` (``attach``) with the shards it holds and runs the graph.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        traced: TracedModel,
        graph_module: torch.fx.GraphModule,
        plan: Plan,
        groups: tuple[str, ...],
        coordinate: tuple[int, ...],
        mesh_shape: tuple[int, ...],
        offloader: Any = None,
        num_microbatches: int = 1,
    ):
        """``groups`` and ``coordinate`` are the process groups and this rank's position on the
        mesh of ``mesh_shape`` that the shards are cut on: the plan's mesh, or a pipeline's stage
        mesh. ``traced`` is traced at one microbatch, and a call takes ``num_microbatches`` of
        them along dim 0 of each input."""
        super().__init__()
        self._plan = plan
        self._traced = traced
        self._groups = groups
        self._coordinate = coordinate
        self._mesh_shape = tuple(mesh_shape)
        self._device_mesh: Any = None
        self._offloader = offloader
        self.graph_module = graph_module
        self._model_name = model._get_name()
        self.module = self._holder(model)
        originals.watch(model, self)  # an optimizer stepping the model's own parameters is refused
        full = model_tensors(model)
        self._full_shapes = {fqn: tuple(t.shape) for fqn, t in full.items()}
        self._full_dtypes = {fqn: t.dtype for fqn, t in full.items()}
        self._inputs = [(gi.name, gi.kind, gi.fqn) for gi in traced.inputs]
        self._constants = dict(traced.constants)
        held = {gi.fqn for gi in traced.inputs if gi.kind in ("param", "buffer")}
        # The original state_dict()'s names, in its order: tied names, no non-persistent buffers.
        self._state_keys = [k for k in model.state_dict(keep_vars=True) if k in held or k in traced.ties]
        self._user_metas = user_metas(traced, num_microbatches)
        self._grad_inputs = grad_inputs(traced)
        self._written_inputs = written_inputs(traced.gm)  # a call may not alias these (trace.aliases)
        self._shape_hint = " (its example inputs)"

    # -- what a subclass says --------------------------------------------------------------------

    def _holder(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module tree that holds the shards under the model's names (``attach`` fills it)."""
        return Holder()

    def _contributes(self, fqn: str) -> bool:
        """Whether this rank's shard of ``fqn`` is read to make the whole tensor (``full_state_dict``)."""
        return True

    def _gather(self, fqn: str, local: torch.Tensor | None) -> torch.Tensor | None:
        """The whole tensor of ``fqn`` on every rank, from ``local`` where ``_contributes(fqn)``."""
        return None if local is None else gather_tensor(local, self._plan.params[fqn], self._groups, self._full_shapes.get(fqn))

    # -- shared ----------------------------------------------------------------------------------

    @property
    def plan(self) -> Plan:
        return self._plan

    @property
    def graph(self) -> torch.fx.Graph:
        return self.graph_module.graph

    @property
    def coordinate(self) -> tuple[int, ...]:
        """This rank's position on the mesh."""
        return self._coordinate

    @property
    def device_mesh(self) -> Any:
        """A ``DeviceMesh`` over autopar's mesh-axis process groups (made on first use)."""
        if self._device_mesh is None:
            self._device_mesh = device_mesh(self._mesh_shape, self._groups)
        return self._device_mesh

    @property
    def offloader(self) -> Any:
        """The ``autopar.runtime.offload.Offloader`` of a plan that offloads, else None."""
        return self._offloader

    @property
    def ties(self) -> dict[str, str]:
        """Tied parameter FQN → the FQN of the first name of the tensor it shares."""
        return self._traced.ties

    def held_tensor(self, fqn: str) -> torch.Tensor:
        """The tensor registered under ``fqn`` (a DTensor parameter, a plain one, or a buffer)."""
        return self._held(fqn)

    def local_shard(self, fqn: str) -> torch.Tensor:
        """This rank's shard of the parameter or buffer ``fqn``: a plain tensor sharing the held
        tensor's storage (or the offload store's copy), which checkpoint loading writes in place."""
        return self._local(fqn)

    # -- the model's names ------------------------------------------------------------------------
    # ``named_parameters()`` names the model's tensors as eager does (``model.layers.0...``, no
    # ``module.``); its modules are named alike, so that code pairing modules with parameters by
    # name finds them: Hugging Face Trainer's weight-decay groups (``get_parameter_names`` walks
    # ``named_children()``) put every parameter in the no-decay group when the two disagreed.

    def _get_name(self) -> str:
        """The model's name, as eager's ``_get_name()`` gives it: code that tells models apart by it
        treats this module as the model (Hugging Face Trainer's label smoother shifts the labels of
        a causal LM by it; with the module's own class name it smoothed unshifted labels, another
        loss than eager's, without a word)."""
        return self._model_name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({super().__repr__()})"

    def named_children(self) -> Iterator[tuple[str, torch.nn.Module]]:
        """The model's own children under the model's own names, as eager's ``named_children()``."""
        return self.module.named_children()

    def named_modules(
        self, memo: set[torch.nn.Module] | None = None, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.nn.Module]]:
        """This module as the model's root, then the model's modules under the model's own names,
        as eager's ``named_modules()`` (the compiled graph's modules are not the model's)."""
        memo = set() if memo is None else memo
        if remove_duplicate:
            if self in memo:
                return
            memo.update((self, self.module))
        yield prefix, self
        for name, child in self.module.named_children():
            yield from child.named_modules(memo, f"{prefix}.{name}" if prefix else name, remove_duplicate)

    def apply(self, fn: Callable[[torch.nn.Module], None]) -> ShardedModule:
        """``torch.nn.Module.apply`` over the model's modules, its root (``pm.module``, of the
        model's class) included, as on the eager model, then this module."""
        self.module.apply(fn)
        fn(self)
        return self

    def train(self, mode: bool = True) -> ShardedModule:
        """``torch.nn.Module.train`` over what this module holds (the model and the graph), which
        ``named_children()`` no longer lists."""
        if not isinstance(mode, bool):
            raise ConfigTypeError(f"train(mode) takes True or False, got {mode!r}; eval() is train(False)")
        self.training = mode
        for module in self._modules.values():
            module.train(mode)
        return self

    def state_dict_keys(self) -> list[str]:
        """The names of ``state_dict()``: those of the original model's ``state_dict()``."""
        return list(self._state_keys)

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> dict[str, Any]:
        """The original model's ``state_dict()`` names (in a pipeline, those this rank's stages
        hold), each a DTensor over ``device_mesh`` with the plan's placements that shares this
        rank's shard (no copy). For ``torch.distributed.checkpoint``: ``dcp.save(pm.state_dict(),
        checkpoint_id=path)``; ``sd = pm.state_dict(); dcp.load(sd, checkpoint_id=path)`` reads
        into the shards (DCP puts a pipeline's parts together into the whole model)."""
        refuse_trainer_save()  # Hugging Face Trainer's save, from rank 0 alone (runtime.trainer_saves)
        self._check_shard_data()
        out = model_state_dict(self)
        if destination is None:
            return out if not prefix else {prefix + k: v for k, v in out.items()}
        for key, value in out.items():
            destination[prefix + key] = value
        return destination

    def local_state_keys(self) -> list[str]:
        """The names of ``state_dict()`` whose shards this rank holds: every one (a pipeline
        stage's module holds its stages' only)."""
        return self.state_dict_keys()

    @property
    def shard_mesh_shape(self) -> tuple[int, ...]:
        """The mesh the shards are cut on: the plan's, or a pipeline's stage mesh."""
        return self._mesh_shape

    def whole_param_names(self, groups: list[list[str]]) -> list[list[str]]:
        """The FQNs of each optimizer param group over the whole model, from this rank's
        (``groups``): the same here; a pipeline gathers them from its stages."""
        return [list(names) for names in groups]

    def local_params_of(self, names: list[str]) -> list[str]:
        """Of a param group's FQNs over the whole model, those this rank's optimizer steps."""
        return list(names)

    def full_shape(self, fqn: str) -> tuple[int, ...]:
        """The whole (unsharded) shape of the parameter or buffer ``fqn``."""
        return self._full_shapes[fqn]

    def local_param_bytes(self) -> int:
        """Bytes of parameters this rank holds (each shared tensor counted once)."""
        return sum(local_of(p).numel() * p.element_size() for p in self.parameters())

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The original model's ``state_dict()``, gathered whole on every rank.

        Same names (tied names both present, sharing one tensor, as in the model's own state
        dict; non-persistent buffers left out), so ``model.load_state_dict(pm.full_state_dict())``
        loads into the unsharded model. A parameter the plan offloads is gathered on the device
        one at a time and handed back in host memory, where the whole model may fit when the
        device does not hold it.
        """
        self._check_shard_data()
        self._agree_on_gather()
        offloaded: Collection[str] = ()
        if self._offloader is not None:
            self._offloader.store.take_back()  # weights loaded in place into state_dict()'s copies
            offloaded = self._offloader.params
        out: dict[str, torch.Tensor] = {}
        whole: dict[str, torch.Tensor] = {}
        for fqn in self._state_keys:
            canonical = self._traced.ties.get(fqn, fqn)
            if canonical not in whole:
                whole[canonical] = self._gathered(fqn, self._local(fqn) if self._contributes(fqn) else None, offloaded)
            out[fqn] = whole[canonical]
        return out

    def _check_shard_data(self) -> None:
        """Refuse to hand out a DTensor parameter whose ``.data`` was assigned, which torch ignores
        (``ops.params.data_replaced``): a pipeline's shards are plain, so here there is none."""

    def _gathers(self) -> bool:
        """Whether putting the whole state together needs other ranks: a tensor the plan shards."""
        return any(is_sharded(placement) for spec in self._plan.params.values() for placement in spec)

    def _agree_on_gather(self) -> None:
        """Every rank gathers the whole state together. One all-gather, the same as a forward's data
        check (``runtime.data``), so a rank that gathers alone (a checkpoint on the master rank of a
        sharded plan) meets the others' next forward, and every rank raises at once instead of
        waiting out the process-group timeout. Nothing where no other rank is needed."""
        if dist.get_world_size() == 1 or not self._gathers():
            return
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        whole = DataLayout("whole", (), (dist.get_world_size(),))
        count = int(getattr(self, "_num_calls", 0))
        start_check(list, [], whole, (0,), device, None, (count, GATHER))[1]()

    @torch.no_grad()
    def full_grads(self) -> dict[str, torch.Tensor | None]:
        """Every parameter's gradient, gathered whole, under the model's original names; one the
        plan offloads in host memory, as in ``full_state_dict`` (``_gathered``)."""
        offloaded = self._offloader.grads if self._offloader is not None else ()
        out: dict[str, torch.Tensor | None] = {}
        for fqn, kind in self._fqns():
            if kind == "param":
                out[fqn] = self._gathered(fqn, self._grad(fqn) if self._contributes(fqn) else None, offloaded)
        return out

    def _gathered(self, fqn: str, local: torch.Tensor | None, offloaded: Collection[str]) -> torch.Tensor | None:
        """``_gather``'s whole tensor of ``fqn``, in host memory where the plan offloads it (its
        canonical name in ``offloaded``): gathered on the device one at a time, never all there."""
        value = self._gather(fqn, local)
        if value is not None and self._traced.ties.get(fqn, fqn) in offloaded:
            return value.cpu()
        return value

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the whole model's gradients to ``max_norm`` and return their total norm (before
        clipping, the same on every rank), as ``torch.nn.utils.clip_grad_norm_`` does on the
        unsharded model. Right for every plan, the pipelined one included (a rank holds one
        stage there, so torch's own call would see a part of the model), and for gradients the
        plan offloads. Every rank calls it: one all-reduce over the default group."""
        total = self.grad_norm(norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()}), so it "
                "cannot be clipped; pass error_if_nonfinite=False to clip anyway"
            )
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for fqn in self._grad_fqns():
            grad = self._grad(fqn)
            if grad is None:
                continue
            grad.mul_(coef.to(grad.dtype))
            if self._offloader is not None and fqn in self._offloader.grads:  # the store gave a copy
                self._offloader.store.put(grad_key(fqn), grad)
        return total

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> ShardedModule:
        """``to``, ``half``, ``double``, ``cuda`` ... after compile: the shards stay where and as
        the plan put them. A call that would change nothing returns the module; one that would
        cast or move a tensor is refused (the plan, its buffers and gathers are made for them)."""
        for name, tensor in [*self.module.named_parameters(), *self.module.named_buffers()]:
            local = local_of(tensor)
            if local.numel() == 0:  # an offloaded parameter's stub, or an empty shard
                continue
            probe = fn(torch.empty(0, dtype=local.dtype, device=local.device))
            if probe.dtype != local.dtype or probe.device != local.device:
                raise ConfigTypeError(
                    f"cannot cast or move a compiled module ({name}: {local.dtype} on {local.device} would become "
                    f"{probe.dtype} on {probe.device}): autopar placed its shards for the plan. Cast or move the "
                    "model before autopar.compile (model.to(...)), or pass precision='bf16-mixed' or 'bf16-true' "
                    "to compile for bf16 compute"
                )
        return self

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's ``no_sync()``: gradient accumulation with one reduction per optimizer step. Inside
        it, the all-reduces of parameters whose gradients only a bucket writes (``ops.buckets``:
        replicated parameters, as DDP's) are held back, each ``.grad`` this rank's unreduced sum as
        DDP's is, and reduced with the next backward outside it; the step's gradients are eager's.
        Reduce-scatters (sharded parameters), reductions inside a compiled or unscheduled graph, and
        pipelines still reduce at every backward (said once in the log)."""
        buckets = self._no_sync_buckets()
        if not _no_sync_said:
            _no_sync_said.append(True)
            log.info(
                "autopar: no_sync() holds back the all-reduces of replicated parameters' gradients until the next "
                "backward outside it%s; reduce-scatters (sharded parameters), compiled graphs and pipelines still "
                "reduce at every backward",
                "" if buckets else " (this module has none it can hold)",
            )
        for bucket in buckets:
            bucket.sync = False
        try:
            yield
        finally:
            for bucket in buckets:
                bucket.sync = True

    def _no_sync_buckets(self) -> list[Any]:
        """The gradient buckets ``no_sync()`` turns off (``ops.buckets.GradBuckets``); none here."""
        return []

    @property
    def require_backward_grad_sync(self) -> bool:
        """DDP's flag: False holds back gradient all-reduces as inside ``no_sync()`` until it is
        True again (nanoGPT sets it per micro-step: True on the last one only)."""
        return all(bucket.sync for bucket in self._no_sync_buckets())

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        if not value:
            with self.no_sync():  # its once-per-process log, and the buckets it can hold
                pass
        for bucket in self._no_sync_buckets():
            bucket.sync = bool(value)

    @torch.no_grad()
    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The total norm of order ``norm_type`` of the whole model's gradients (every rank calls
        it; the same value on each). Each shard counts once: a rank adds the shards it holds that
        no rank before it on a replicating mesh axis (or in an earlier pipeline stage) holds."""
        norm_type = float(norm_type)
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        parts = [
            torch.linalg.vector_norm(grad, norm_type)
            for fqn in self._grad_fqns()
            if self._counts(fqn) and (grad := self._grad(fqn)) is not None
        ]
        # the same dtype on every rank (a rank may count no shard): float64 if the model has any
        dtype = torch.float64 if torch.float64 in self._full_dtypes.values() else torch.float32
        parts = [part.to(device, dtype) for part in parts]
        if math.isinf(norm_type):
            total = torch.stack(parts).max() if parts else torch.zeros((), dtype=dtype, device=device)
            dist.all_reduce(total, op=dist.ReduceOp.MAX)
            return total
        total = torch.stack(parts).pow(norm_type).sum() if parts else torch.zeros((), dtype=dtype, device=device)
        dist.all_reduce(total)
        return total.pow(1.0 / norm_type)

    def _grad_fqns(self) -> list[str]:
        """The canonical names of the parameters this rank holds."""
        return sorted(
            {
                self._traced.ties.get(fqn, fqn)
                for fqn, kind in self._fqns()
                if kind == "param" and (has(self.module, fqn) or has(self.module, self._traced.ties.get(fqn, fqn)))
            }
        )

    def _counts(self, fqn: str) -> bool:
        """Whether this rank's shard of ``fqn`` is the one counted in a sum over the model: held
        where it contributes, and at coordinate 0 of every mesh axis that replicates it."""
        spec = self._plan.params[fqn]
        return self._contributes(fqn) and all(
            is_sharded(placement) or index == 0 for placement, index in zip(spec, self._coordinate)
        )

    def _user_inputs(
        self,
        args: tuple,
        kwargs: dict,
        metas: list | None = None,
        flattened: Flattened | None = None,
        traced: TracedModel | None = None,
    ) -> list[Any]:
        """The user inputs of a call, flat in graph order, checked against the planned ones
        (``metas`` and ``traced``: those of a graph for other input shapes or arguments,
        ``runtime.shapes``; ``flattened``: the call's ``tree_flatten``, where the caller made it)."""
        metas = self._user_metas if metas is None else metas
        traced = self._traced if traced is None else traced
        grads = self._grad_inputs if traced is self._traced else grad_inputs(traced)
        flat = flatten_inputs(args, kwargs, traced.in_spec, [name for name, _, _ in metas], flattened)
        check_call_aliases(flat, [name for name, _, _ in metas], self._written_inputs)
        if self._plan.precision is not None:  # floating inputs in param_dtype, as traced
            flat = [self._plan.precision.cast_inputs(value) for value in flat]
        for value, (name, shape, dtype) in zip(flat, metas):
            if is_constant(shape):
                _check_constant(name, value, shape)
                continue
            if shape is None or not isinstance(value, torch.Tensor):
                continue
            if value.is_meta and not any(self._local(fqn).is_meta for fqn, _ in self._fqns()):
                raise InputError(
                    f"input {name!r} is on the meta device, which holds no values: meta inputs can plan and "
                    "compile (as example inputs), but a call computes; pass real tensors"
                )
            if value.requires_grad and name not in grads and torch.is_grad_enabled() and math.prod(self._mesh_shape) > 1:
                raise InputError(
                    f"input {name!r} requires grad, but the example input {name!r} did not when the module was "
                    "planned: its gradient would not be summed over the ranks that share it, and would be wrong. "
                    f"Compile with an example input that requires grad (example.requires_grad_()), or pass "
                    f"{name}.detach() where its gradient is not needed"
                )
            if tuple(value.shape) != shape or value.dtype != dtype:
                raise InputError(
                    f"input {name!r} has shape {tuple(value.shape)} and dtype {value.dtype}, but this module "
                    f"was planned for shape {shape} and dtype {dtype}{self._shape_hint}. Pass inputs of the "
                    "planned shape, or compile again with example inputs of the new shape"
                )
        return flat

    def _fqns(self) -> list[tuple[str, str]]:
        names = [(fqn, kind) for _, kind, fqn in self._inputs if kind in ("param", "buffer")]
        seen = {fqn for fqn, _ in names}
        names += [(fqn, "param") for fqn in self._traced.ties if fqn not in seen]
        return names

    def _cut(self, fqn: str, whole: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the whole tensor ``whole`` of ``fqn`` (a view where it can be)."""
        return shard_tensor(whole.detach(), self._plan.params[fqn], self._coordinate, self._mesh_shape)

    def _held(self, fqn: str) -> torch.Tensor:
        """The tensor registered under ``fqn``, or under its tie's first name if only that one is
        held: a parameter (a DTensor, or a plain one where the module keeps them so) or a buffer."""
        canonical = self._traced.ties.get(fqn, fqn)
        return lookup(self.module, fqn if has(self.module, fqn) else canonical)

    def _local(self, fqn: str) -> torch.Tensor:
        """This rank's shard under ``fqn``, a plain tensor sharing the held tensor's storage (read
        from the offload store where the plan offloads it)."""
        canonical = self._traced.ties.get(fqn, fqn)
        if self._offloader is not None and canonical in self._offloader.params:
            return self._offloader.store.get(param_key(canonical))
        return local_of(self._held(fqn))

    def _grad(self, fqn: str) -> torch.Tensor | None:
        """This rank's shard of the gradient of ``fqn`` (plain), or None."""
        canonical = self._traced.ties.get(fqn, fqn)
        if self._offloader is not None and canonical in self._offloader.grads:
            return self._offloader.grad(canonical, self._held(fqn))
        grad = self._held(fqn).grad
        return None if grad is None else local_of(grad)


_CONSTANT = "constant"
# Values whose equality and repr mean the same on every rank; others (objects, a torch.device,
# which differs per rank on GPUs) are entered by type only, as before.
_COMPARED = (bool, int, float, complex, str, torch.dtype, enum.Enum, type(None))


def constant_entry(value: Any) -> tuple[str, str, Any]:
    """A non-tensor argument's entry in a shape key: its type and, where it can be compared alike on
    every rank, its value (the graph holds it as a constant)."""
    return (_CONSTANT, type(value).__qualname__, value if isinstance(value, _COMPARED) else None)


def is_constant(entry: Any) -> bool:
    return isinstance(entry, tuple) and len(entry) == 3 and entry[0] == _CONSTANT


def takes(value: Any, entry: Any) -> bool:
    """Whether a graph planned for ``entry`` (a shape, a ``constant_entry``, or None) takes
    ``value`` as it is: the same constant, or a tensor of that shape."""
    if is_constant(entry):
        return not isinstance(value, torch.Tensor) and constant_entry(value) == entry
    return entry is None or not isinstance(value, torch.Tensor) or tuple(value.shape) == entry


def _check_constant(name: str, value: Any, entry: Any) -> None:
    """InputError where argument ``name`` is not the value its graph holds as a constant."""
    if not takes(value, entry):
        raise InputError(
            f"argument {name!r} is {value!r}, but this module runs a graph traced with {name}={entry[2]!r} (its "
            "example inputs), which holds that value as a constant: eager would compute with the new one. Pass "
            f"{entry[2]!r}, pass a value that changes as a tensor, or compile with the value you pass (a module "
            "without a pipeline traces a graph per value)"
        )


def grad_inputs(traced: TracedModel) -> set[str]:
    """The user inputs traced as requiring grad: the plan sums their gradients over the ranks that share them."""
    placeholders = {n.name: n for n in traced.gm.graph.nodes if n.op == "placeholder"}
    return {gi.name for gi in traced.inputs if gi.kind == "user" and requires_grad(placeholders[gi.name])}


def user_metas(traced: TracedModel, num_microbatches: int) -> list[tuple[str, Any, Any]]:
    """(name, shape, dtype) of each user input a call takes (``constant_entry``, None for an
    argument that is not a tensor: the graph holds its example value, ``runtime.shapes``)."""
    placeholders = {n.name: n for n in traced.gm.graph.nodes if n.op == "placeholder"}
    metas = []
    for gi in traced.inputs:
        if gi.kind != "user":
            continue
        val = placeholders[gi.name].meta.get("val")
        if not isinstance(val, torch.Tensor):  # a constant of the graph (runtime.shapes)
            metas.append((gi.name, constant_entry(val), None))
            continue
        shape = tuple(val.shape)
        if val.dim():
            shape = (shape[0] * num_microbatches, *shape[1:])
        metas.append((gi.name, shape, val.dtype))
    return metas
