"""ParallelModule: the compiled model, an nn.Module over this rank's shards."""

from __future__ import annotations

import datetime
import functools
import logging
import math
import operator
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor, Replicate

from autopar.errors import ConfigError, UsageError
from autopar.ir.plan import Plan
from autopar.ops import collectives
from autopar.ops.buckets import GradBuckets
from autopar.ops.params import LocalLeaf, adopt_in_backward_optimizers, local_of
from autopar.passes.schedule import bind_parameters
from autopar.runtime import autograd_calls, loaded_state, originals, scalar_reads, shapes, stale_model, trainer_saves
from autopar.runtime.attribute_guard import AttributeGuard
from autopar.runtime.base import (
    Flattened,
    ShardedModule,
    attach,
    has,
    lookup,
    model_tensors,
    takes,
    user_metas,
)
from autopar.runtime.checkpoint import load_model_state_dict, to_dtensor
from autopar.runtime.compiled import run_eager, under_autocast, warn_not_compiled
from autopar.runtime.data import RandomOps, random_ops, start_check, writes_state
from autopar.runtime.hook_guard import HookGuard
from autopar.runtime.model_view import ModelAttributes, local_model, model_view
from autopar.runtime.modes import (
    ModeBuilder,
    ModeGraph,
    ModeKey,
    describe_mode,
    frozen_parameters,
    mode_key,
    mode_name,
    same_graph,
    unfrozen,
)
from autopar.runtime.offload import param_key
from autopar.runtime.optim_guard import watch_shard_data
from autopar.runtime.signature import forward_signature
from autopar.trace import TracedModel

log = logging.getLogger("autopar")
# ParallelModule → the model on its rank's whole tensors, for evaluation without communication
_LOCAL_MODELS: weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module] = weakref.WeakKeyDictionary()
_TRAINING = operator.attrgetter("training")


class ParallelModule(ModelAttributes, ShardedModule):
    """Runs the rewritten graph on this rank's shards.

    Called like the original model with whole inputs (the same on every rank), or under a plan
    made with ``batch="per_rank"`` with each data-parallel rank's own rows
    (``data_parallel_rank``, ``data_parallel_size``); returns the model's outputs, whole on every
    rank. ``train()`` and ``eval()`` run the graph of their mode (``autopar.runtime.modes``). ``pm.module`` holds the parameters under the model's
    own names, and ``named_parameters()``, ``state_dict()`` and ``full_state_dict()`` use those
    names (no ``module.`` prefix). Each parameter is an ``nn.Parameter`` that is a
    DTensor on ``pm.device_mesh`` with the plan's placements, as FSDP2's are, and so is its
    ``.grad``: torch's ``clip_grad_norm_``, optimizers and ``get_state_dict`` compute on the whole
    model. The graph runs on the local shards (``autopar.ops.params.LocalLeaf``). Where the plan
    replicates every parameter they are plain tensors, as DDP's are. Buffers are held as local
    shards; ``state_dict()`` shows every entry as a DTensor, for torch.distributed.checkpoint
    (``autopar.runtime.checkpoint``). A parameter the plan offloads is an empty plain stub (its
    shard's dims, none of its elements: its first is 0) whose shard lives in the offload store
    (step it with ``autopar.optim.AdamW``).
    """

    _compiled_graph = None  # under compiler="inductor": runtime.compiled.CompiledGraph (run_compiled)
    # Hugging Face Trainer and accelerate (docs/huggingface.md): accelerate's prepare_model returns a
    # module it has prepared as it is, so it wraps none in DDP.
    _is_accelerate_prepared = True
    _num_calls = 0  # calls that ran the graph: the ranks compare it (runtime.data.check_same_call)

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
        build_mode: ModeBuilder | None = None,
        training: bool = True,
    ):
        """``local_shards`` (FQN → this rank's shard) replaces cutting the model's own tensors:
        ``compile`` passes it for models on the meta device (``autopar.runtime.materialize``).
        ``offloader`` (``autopar.runtime.offload.Offloader``) holds the parameters, gradients and
        optimizer state the plan offloads: an offloaded parameter's shard goes to its store, and
        the module holds an empty stub in its place (step with ``autopar.optim.AdamW``).
        ``gm`` is the graph of the model's mode (``training``, each module in its own);
        ``build_mode(mode)`` makes another mode's graph when it is first called (``runtime.modes``;
        None: the module runs in the mode it was compiled in only)."""
        super().__init__(model, traced, gm, plan, groups, coordinate, tuple(plan.mesh_shape), offloader)
        # pm.module's modules, each in its own mode (a call's mode is theirs: runtime.modes)
        self._shells = list(self.module.named_modules())
        self._shell_modules = [module for _, module in self._shells]
        # every module's flag and each frozen parameter's requires_grad → its ModeKey
        self._mode_keys: dict[tuple[bool, tuple[bool, ...], frozenset[str]], ModeKey] = {}
        self._modes: dict[ModeKey, ModeGraph] = {mode_key(training, model.named_modules()): ModeGraph(traced, plan)}
        # Per mode graph, read once (runtime.data): whether it writes a buffer, its random ops on replicated tensors.
        self._graph_facts: dict[str, tuple[bool, RandomOps | None]] = {}
        self._riding: set[str] = set()  # graphs whose data check rides on their first all-reduce (_learn_riding)
        self._readers: dict[str, list[tuple[str, Any, str, str | None]]] = {}  # per graph: _graph_values
        self._build_mode = build_mode
        # Graphs for calls of other input shapes (runtime.shapes), by (mode, shapes).
        self._by_shape: dict[tuple[ModeKey, shapes.ShapeKey], ModeGraph] = {}
        self._shape_attrs: set[str] = set()
        self._buckets_of: dict[str, list[GradBuckets]] = {}  # mode graph attribute -> its gradient buckets
        self._shape_metas: dict[str, list] = {}
        self._signature = forward_signature(model)  # lays out a call that passes the example's arguments another way
        self._data = plan.data_layout
        if self._data.per_rank:
            self._expect_per_rank_rows()
        self._check_device = (
            torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        )
        # Where the plan replicates every parameter (data parallel, or one device), they are plain
        # tensors, as DDP's are: no DTensor dispatch in autograd's accumulation or the optimizer's step.
        self._plain_params = all(isinstance(p, Replicate) for spec in plan.params.values() for p in spec)
        made = self._make_shards(model, traced, plan, local_shards, offloader)
        # By name, not by id(): a deepcopy of the module (swa_utils.AveragedModel) copies these too.
        leaves: dict[int, LocalLeaf] = {}
        self._leaves = {fqn: leaves.setdefault(id(p), LocalLeaf(p, fqn)) for fqn, p in made.items() if isinstance(p, DTensor)}
        watch_shard_data(leaves.values())  # a step after a .data assignment, which a DTensor ignores
        autograd_calls.install()  # grad and backward(inputs=) reach the leaves; grad into a bucket is refused
        scalar_reads.install()  # .item() of a reduction over a shard is refused, not this rank's part
        if offloader is not None:
            offloader.attach_grad_hooks(
                {traced.ties.get(fqn, fqn): p for fqn, p in made.items() if isinstance(p, torch.nn.Parameter)}
            )
        # The communication schedule's buckets and gathers read and write these shards.
        self._bind(gm, self._inputs)
        self.train(training)
        for (_, shell), (_, module) in zip(self._shells, model.named_modules()):
            shell.training = module.training  # each module in the mode it was traced in, as the model
        self._hook_guard = HookGuard.install(self.module)  # a hook added after compile would not run: refused
        self._attribute_guard = AttributeGuard(self, self.module, model, traced.reads)  # nor would an attribute set
        self._frozen = frozen_parameters(self.module)  # one unfrozen later trains in a graph of its own
        held = {fqn for fqn, p in made.items() if isinstance(p, torch.nn.Parameter)}
        originals.bind(model, self, held if offloader is None else set())  # optimizers built before
        loaded_state.track(self, {traced.ties.get(fqn, fqn): p for fqn, p in made.items() if isinstance(p, DTensor)})
        trainer_saves.watch_trainers(self)  # Trainer's own saves (rank 0 alone) are refused at its first step

    def _make_shards(
        self,
        model: torch.nn.Module,
        traced: TracedModel,
        plan: Plan,
        local_shards: Mapping[str, torch.Tensor] | None,
        offloader: Any,
    ) -> dict[str, torch.Tensor]:
        """This rank's shard of each parameter and buffer, by FQN (tied names share one), held
        under the model's names in ``self.module``; an offloaded parameter's shard goes to its store."""
        full = model_tensors(model)
        # Each shard is stored in its placeholder's dtype: the model's own, or under a precision
        # policy the master dtype (or param_dtype where the policy keeps no master copy).
        dtypes = {
            n.name: n.meta["val"].dtype
            for n in traced.gm.graph.nodes
            if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
        }
        made: dict[str, torch.Tensor] = {}
        trains_apart = originals.trained_itself(model)  # a model trained beside an earlier pm keeps its own
        for graph_input in traced.inputs:
            if graph_input.kind not in ("param", "buffer"):
                continue
            fqn = graph_input.fqn
            canonical = traced.ties.get(fqn, fqn)
            if canonical in made:
                made[fqn] = made[canonical]
                attach(self.module, fqn, made[canonical], graph_input.kind)
                continue
            offloaded = offloader is not None and graph_input.kind == "param" and canonical in offloader.params
            dtype = dtypes.get(graph_input.name, full[fqn].dtype)
            if local_shards is not None:
                local = local_shards[fqn].to(dtype)
            else:  # the model's own tensor where the plan holds it whole, as DDP does; else a copy
                local = self._cut(fqn, full[fqn]).to(dtype)
                shared = stale_model.same_tensor(local, full[fqn]) and not trains_apart and not stale_model.lent(full[fqn])
                if not offloaded and not shared:  # (offloaded: no resident copy, straight to the store)
                    local = local.clone()
            if offloaded:
                offloader.store.put(param_key(canonical), local)
                # no element, but the shard's dims past the first: what code that groups parameters by
                # their dims sees (weight decay for matrices, ``p.dim() >= 2``) is the parameter's
                local = torch.empty((0, *local.shape[1:]), dtype=local.dtype, device=local.device)
                if not self._plain_params:
                    offloader.whole[canonical] = functools.partial(
                        to_dtensor, spec=plan.params[fqn], full_shape=tuple(full[fqn].shape), mesh=self.device_mesh
                    )
            if graph_input.kind == "param":
                if not offloaded and not self._plain_params:  # a DTensor on the device mesh, as FSDP2's are
                    local = to_dtensor(local, plan.params[fqn], tuple(full[fqn].shape), self.device_mesh)
                value: torch.Tensor = torch.nn.Parameter(local, requires_grad=full[fqn].requires_grad)
            else:
                value = local
            made[canonical] = value
            made[fqn] = value
            attach(self.module, fqn, value, graph_input.kind)
        return made

    def run_compiled(self, runner: Callable[..., Any] | None) -> None:
        """Run the graph of the mode it was compiled in with ``runner`` (``runtime.compiled.graph_runner``:
        inductor's compiled graph) instead of op by op; None runs it op by op."""
        self._compiled_graph = runner
        self._buckets_of.clear()  # which graph's buckets no_sync() holds back changes with it

    def shard_like(self, fqn: str, whole: torch.Tensor) -> torch.Tensor:
        """A copy of this rank's shard of ``whole`` (a tensor of parameter ``fqn``'s whole shape,
        such as its optimizer state) as a tensor of the parameter's kind: a DTensor with its
        placements, or a plain tensor where the plan replicates every parameter. A DTensor (state
        saved from an optimizer over a compiled module's parameters) is gathered first: every rank
        calls it then."""
        if isinstance(whole, DTensor):
            whole = whole.full_tensor()
        local = self._cut(fqn, whole.to(local_of(self.held_tensor(fqn)).device)).clone()
        if self._plain_params:
            return local
        return to_dtensor(local, self._plan.params[fqn], tuple(whole.shape), self.device_mesh)

    def _holder(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model's own classes hold the shards (``runtime.model_view``): ``pm.module`` is the model."""
        return model_view(model, self)

    def _expect_per_rank_rows(self) -> None:
        """A call passes this data-parallel rank's rows of each batched input."""
        self._user_metas = shapes.rank_rows(self._user_metas, self._data)
        self._shape_hint = (
            f" (batch='per_rank': 1/{self._data.size} of the example inputs' batch, the rows of "
            f"data-parallel rank {self.data_parallel_rank} of {self._data.size})"
        )

    @property
    def data_parallel_size(self) -> int:
        """How many data-parallel ranks the plan splits the batch into: the product of the sizes of
        the mesh axes that split dim 0 of the batched inputs (1 where none does)."""
        return self._data.size

    @property
    def data_parallel_rank(self) -> int:
        """This rank's data-parallel rank: its position on the batch-splitting mesh axes, row-major.
        Under ``batch="per_rank"`` it passes rows ``[r * b, (r + 1) * b)`` of a global batch,
        ``b = B / data_parallel_size``, as ``DistributedSampler(num_replicas=pm.data_parallel_size,
        rank=pm.data_parallel_rank)`` deals them."""
        return self._data.rank(self._coordinate)

    @property
    def batch_mode(self) -> str:
        """ "whole" (every rank passes the same whole batch) or "per_rank" (each data-parallel rank its rows)."""
        return self._data.batch

    def _bind(self, gm: torch.fx.GraphModule, inputs: list[tuple[str, str, str | None]]) -> None:
        # The communication schedule's buckets and gathers read and write these shards.
        bind_parameters(gm, {name: lookup(self.module, fqn) for name, kind, fqn in inputs if kind == "param"})

    def _mode(self) -> ModeKey:
        """The mode of this call: ``pm``'s, and each module of ``pm.module`` in its own (``runtime.modes``)."""
        flags = (self.training, tuple(map(_TRAINING, self._shell_modules)), unfrozen(self._frozen))  # no Python loop
        stale_model.check_modes(self, flags[1])  # the model's own switched instead (DDP's pre-wrap name)
        key = self._mode_keys.get(flags)
        if key is None:
            key = self._mode_keys[flags] = mode_key(self.training, self._shells, flags[2])
        return key

    def _mode_graph(self, mode: ModeKey) -> ModeGraph:
        """The graph of ``mode``, made on first use (``runtime.modes``)."""
        run = self._modes.get(mode)
        return run if run is not None else self._make_mode_graph(mode)

    @torch._dynamo.disable(reason="traces and plans the graph of a mode once, outside a user's torch.compile(pm)")
    def _make_mode_graph(self, mode: ModeKey) -> ModeGraph:
        if self._build_mode is None:
            compiled = describe_mode(next(iter(self._modes)))
            raise UsageError(
                f"this module was compiled in {compiled} mode and cannot make a graph for {describe_mode(mode)} mode "
                f"here: run it in the mode it was compiled in (pm.train() or pm.eval()), or compile the model in the "
                "mode you call it in"
            )
        log.info("autopar: tracing and planning the graph of %s mode (its first call) ...", describe_mode(mode))
        traced, gm, plan = self._build_mode(mode)
        self._attribute_guard.add(traced.reads)
        same = next((run for run in self._modes.values() if same_graph(run.traced, traced)), None)
        if same is not None:  # the model's code does not branch on what changed
            run = same
        else:
            suffix = f"_{len(self._modes)}" if mode.odd or mode.unfrozen else ""
            run = ModeGraph(traced, plan, f"{mode_name(mode.training)}_graph_module{suffix}")
            self._bind(gm, run.inputs)
            self.add_module(run.attr, gm.train(mode.training))
        self._modes[mode] = run
        return run

    @property
    def accepts_loss_kwargs(self) -> bool:
        """Whether Hugging Face Trainer passes ``num_items_in_batch`` (the label tokens of every rank's
        rows) and multiplies the loss by the process count, as for a model under DDP (Trainer reads it
        once, as it is made). Yes for a Trainer whose label smoother computes the loss from each
        rank's logits (``label_smoothing_factor``): without the count each rank's loss was its own
        tokens' mean, and the step their mean, not eager's (nor DDP's) where ranks hold unequal
        numbers of tokens. Yes where Trainer accumulates (``gradient_accumulation_steps`` > 1) over a
        model that takes the count: each micro-batch's loss is its tokens' sum over the whole step's
        count, as one process's, not its own mean (0.1 apart in weights after four steps of padded
        micro-batches); a call multiplies the count by the factor Trainer multiplies the loss by
        (``trainer_saves.per_process_count``), since the model's loss is the whole batch's already.
        Not otherwise: the model's loss is the whole batch's mean."""
        trainer = trainer_saves.calling_trainer()
        if trainer is None:
            return False
        if getattr(trainer.args, "label_smoothing_factor", 0.0):
            return True
        return getattr(trainer.args, "gradient_accumulation_steps", 1) > 1 and trainer_saves.takes_loss_kwargs(
            self.module, self._signature
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if "num_items_in_batch" in kwargs:  # Hugging Face Trainer's count, for a loss it scales after
            kwargs = trainer_saves.per_process_count(kwargs)
        self._hook_guard.check()
        adopt_in_backward_optimizers(self)
        self._attribute_guard.check()
        if self._offloader is not None:
            self._offloader.store.take_back()  # weights loaded in place into state_dict()'s copies (dcp.load)
        mode = self._mode()
        if self._evaluates_locally(args, kwargs, mode):
            return self._local_model()(*args, **kwargs)
        self._num_calls += 1
        if mode not in self._modes:  # its graph is planned with rank 0: agree on the call first
            start_check(list, [], self._data, self._coordinate, self._check_device, None, (self._num_calls, self.training))[1]()
        run = self._mode_graph(mode)
        facts = self._graph_facts.get(run.attr)
        if facts is None:  # read once per mode graph, not on every call
            facts = self._graph_facts[run.attr] = (
                writes_state(getattr(self, run.attr)),
                random_ops(run.traced.gm, run.plan, self._coordinate),
            )
        writes, random = facts
        args, kwargs, flattened, same = self._laid_out(args, kwargs)  # once a call: the check reads the same leaves
        leaves = flattened[0]
        # Inputs of other shapes or arguments than the mode graph's run a graph of their own (runtime.shapes).
        key = shapes.shape_key(leaves) if same else shapes.call_key(flattened[1], leaves)
        run, new = self._shape_graph(run, mode, key)
        flat, settle = start_check(
            lambda: self._check_call(run, new, args, kwargs, flattened),
            leaves,
            self._data,
            self._coordinate,
            self._check_device,
            random,
            (self._num_calls, self.training),
            shapes=shapes.key_number(key),
            defer=run.attr in self._riding,
        )
        if new:  # every rank agrees on the shapes (the settle raises where one differs) before all plan them
            settle()
            run = self._make_shape_graph(mode, key, args, kwargs)
            flat = self._user_inputs(args, kwargs, self._shape_metas[run.attr], flattened, run.traced)
        # The data check settles before the graph's first collective, or at the end (runtime.data),
        # or before the graph where it writes buffers in place.
        if writes:
            settle()
        collectives.before_next_collective(settle)
        try:
            flat, rows = self._rows_in(flat, run)
            outputs = self._run_graph(self._graph_values(run, flat), run, settle)
            self._learn_riding(run.attr, settle)
        finally:  # also where the graph failed: other data is then the likelier cause, and is raised
            collectives.before_next_collective(None)
            settle()
        if torch.is_grad_enabled() and self.training:
            self._release_held(run)
        return pytree.tree_unflatten(self._as_ddp_in_backward(outputs, run, rows), run.traced.out_spec)

    def _release_held(self, run: ModeGraph) -> None:
        """Reduce the gradients ``no_sync()`` holds back in another graph's buckets than ``run``'s
        (one of other shapes, arguments or mode), whose backward would add its own reduced ones
        into those unreduced ``.grad`` views: every rank ran this call's check, so all are here."""
        for attr, buckets in self._mode_buckets().items():
            if attr != run.attr:
                for bucket in buckets:
                    bucket.release_held()

    def _as_ddp_in_backward(self, outputs: Sequence[Any], run: ModeGraph, rows: collectives.RowGrads | None) -> list[Any]:
        """``outputs``, under ``batch="per_rank"`` each that may get a gradient made to give DDP's
        step: the mean of the ranks' losses' gradients, eager's over the whole batch. A batched
        output comes back as this rank's rows (``ModeGraph.row_outputs``), and the graph would sum
        the ranks' gradients of it: each is scaled by ``1 / data_parallel_size``, with no
        communication (``rows`` records it: ``_rows_in``). Any other output comes back whole on
        every rank, and the graph takes its gradient as the same on every rank; a script whose loss
        takes each rank's own rows of it would give every rank another, and the step would be the
        sum of the ranks' losses', without a word: its gradient is averaged over the ranks (one
        all-reduce in backward)."""
        if not self._data.per_rank or self.data_parallel_size == 1 or not torch.is_grad_enabled():
            return list(outputs)
        world, split, factor = dist.group.WORLD.group_name, run.row_outputs, 1.0 / self.data_parallel_size
        averaged = list(outputs)
        for i, out in enumerate(outputs):
            if isinstance(out, torch.Tensor) and out.requires_grad and out.dim():
                averaged[i] = collectives.scale_grad(out, factor, rows) if i in split else collectives.mean_grad(out, world)
        return averaged

    def _rows_in(self, flat: list[Any], run: ModeGraph) -> tuple[list[Any], collectives.RowGrads | None]:
        """``flat``, each of this rank's rows of a batched input that requires grad given back its
        gradient as DDP gives it: the rank's own loss's, without the ``1 / data_parallel_size``
        that ``_as_ddp_in_backward`` gives the row outputs for the parameters' sake."""
        if not run.row_inputs or not torch.is_grad_enabled() or not any(flat[i].requires_grad for i in run.row_inputs):
            return flat, None
        rows, size = collectives.RowGrads(), float(self.data_parallel_size)
        return [
            collectives.rows_input(value, size, rows) if i in run.row_inputs and value.requires_grad else value
            for i, value in enumerate(flat)
        ], rows

    def _learn_riding(self, attr: str, settle: Callable[[], None]) -> None:
        """Whether the next call of graph ``attr`` defers its data check to carry the first
        all-reduce of the call (``runtime.data.start_check``): where this call's check settled at an
        all-reduce of a few numbers (a data-parallel plan's loss). Learned after a call that every
        rank ran (its check passed), so every rank learns alike; where ranks still differ, each
        group's all-reduce runs as it is (``_Check.ride``), so it costs time, never numbers."""
        if getattr(settle, "rode", False):
            self._riding.add(attr)
        else:
            self._riding.discard(attr)

    def _shape_graph(self, run: ModeGraph, mode: ModeKey, key: shapes.ShapeKey) -> tuple[ModeGraph, bool]:
        """The graph for a call of shapes ``key`` in ``mode`` (whose graph is ``run``): ``run`` where
        they are its own, a cached one, or (``True``) one still to make."""
        if key == shapes.metas_key(self._user_metas) or self._build_mode is None:
            return run, False
        cached = self._by_shape.get((mode, key))
        return (run, True) if cached is None else (cached, False)

    def _check_call(self, run: ModeGraph, new: bool, args: tuple, kwargs: dict, flattened: Flattened) -> list[Any]:
        """The call's flat user inputs, checked against its graph's (or, for new shapes or
        arguments, the planned maximum)."""
        if run.attr not in self._shape_attrs and not new:
            return self._user_inputs(args, kwargs, flattened=flattened)
        if not new:  # a graph of its own, made before: its inputs are exactly its trace's
            return self._user_inputs(args, kwargs, self._shape_metas[run.attr], flattened, run.traced)
        if flattened[1] != self._traced.in_spec:  # other arguments than the example's
            metas, hint = self._user_metas, self._shape_hint
            return shapes.check_arguments_within(self._signature, args, kwargs, flattened[0], self._traced, metas, hint)
        return shapes.check_within(args, kwargs, self._traced, self._user_metas, self._shape_hint)

    def _laid_out(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, Flattened, bool]:
        """The call's arguments, their ``tree_flatten`` and whether their structure is the example
        inputs': laid out as the example's where it passes the same arguments another way
        (``shapes.relaid``, looked for only where the structure differs), else as they are."""
        flattened = pytree.tree_flatten((args, kwargs))
        if flattened[1] == self._traced.in_spec:
            return args, kwargs, flattened, True
        laid = shapes.relaid(self._signature, self._traced.in_spec, args, kwargs)
        if laid is None:  # other arguments than the example's
            return args, kwargs, flattened, False
        return laid[0], laid[1], pytree.tree_flatten(laid), True

    @torch._dynamo.disable(reason="traces and plans a graph per input shape once, outside a user's torch.compile(pm)")
    def _make_shape_graph(self, mode: ModeKey, key: shapes.ShapeKey, args: tuple, kwargs: dict) -> ModeGraph:
        other = shapes.is_call_key(key)  # other arguments than the example's: their inputs are the new trace's
        examples = shapes.examples_of(args, kwargs, None if other else self._user_metas, self._data)
        assert self._build_mode is not None
        traced, gm, plan = shapes.timed_build(
            key, describe_mode(mode), lambda: self._build_mode(mode, examples), len(self._by_shape)
        )
        self._attribute_guard.add(traced.reads)
        run = ModeGraph(traced, plan, f"shape_graph_module_{len(self._by_shape)}")
        self._bind(gm, run.inputs)
        self.add_module(run.attr, gm.train(mode.training))
        self._by_shape[(mode, key)] = run
        self._shape_attrs.add(run.attr)
        if other:
            self._shape_metas[run.attr] = self._call_metas(traced, plan)
        else:
            self._shape_metas[run.attr] = [(name, shape, dtype) for (name, _, dtype), shape in zip(self._user_metas, key)]
        return run

    def _call_metas(self, traced: TracedModel, plan: Plan) -> list[tuple[str, Any, Any]]:
        """The user inputs a call of ``traced``'s arguments passes (``runtime.base.user_metas``):
        under ``batch="per_rank"``, a data-parallel rank's rows of each batched one."""
        layout, metas = plan.data_layout, user_metas(traced, 1)
        return shapes.rank_rows(metas, layout) if layout.per_rank and layout.size > 1 else metas

    def _evaluates_locally(self, args: tuple, kwargs: dict, mode: ModeKey) -> bool:
        """In eval mode under ``torch.no_grad()``, a plan that keeps every tensor whole on every
        rank in the model's own dtypes needs no other rank: the call runs the model's own forward
        on this rank's tensors, as DDP's evaluation does (so rank 0 alone may evaluate), and
        returns the model's outputs for the inputs it was given, of any shape. Under
        ``batch="per_rank"`` a call of the planned per-rank shapes still means the global batch (a
        loss reduced over it is the global batch's), which needs every rank: only a call the graph
        cannot take runs locally. A module in another mode than its root's (``mode``) runs its
        graph: the local model runs every one in eval."""
        if self.training or torch.is_grad_enabled() or self._offloader is not None or mode.odd:
            return False
        if self._plan.precision is not None and self._plan.precision.param_dtype is not None:
            return False
        if not all(isinstance(p, Replicate) for spec in self._plan.params.values() for p in spec):
            return False
        return not self._data.per_rank or not self._graph_takes(args, kwargs)

    def _graph_takes(self, args: tuple, kwargs: dict) -> bool:
        """Whether a call's arguments have the planned structure (passed as the example's, or another
        way: ``shapes.relaid``) and shapes."""
        _, _, (flat, _), same = self._laid_out(args, kwargs)
        return same and all(takes(value, shape) for value, (_, shape, _) in zip(flat, self._user_metas))

    def _local_model(self) -> torch.nn.Module:
        eager = _LOCAL_MODELS.get(self)  # not an attribute: a deepcopy of pm makes its own
        if eager is None:
            tensors = {fqn: (local_of(lookup(self.module, fqn)), kind) for _, kind, fqn in self._fqn_inputs()}
            eager = _LOCAL_MODELS[self] = local_model(self.module, tensors).eval()
        return eager

    def _fqn_inputs(self) -> list[tuple[str, str, str]]:
        """(name, kind, FQN) of each parameter and buffer the module holds, tied names included."""
        out = [(name, kind, fqn) for name, kind, fqn in self._inputs if kind in ("param", "buffer")]
        held = {fqn for _, _, fqn in out}
        return out + [("", "param", fqn) for fqn in self._traced.ties if fqn not in held and has(self.module, fqn)]

    def _check_shard_data(self) -> None:
        for leaf in self._leaves.values():
            leaf.check()

    def _no_sync_buckets(self) -> list[GradBuckets]:
        """The gradient buckets of the graphs that run op by op (a compiled graph reduces inside)."""
        return [bucket for buckets in self._mode_buckets().values() for bucket in buckets]

    def _mode_buckets(self) -> dict[str, list[GradBuckets]]:
        """``_no_sync_buckets`` by the attribute of their mode graph (each found once)."""
        out = {}
        for attr in {run.attr for run in self._modes.values()}:
            if attr not in self._buckets_of:
                gm = getattr(self, attr)
                compiled = self._compiled_graph is not None and gm is self.graph_module
                self._buckets_of[attr] = [] if compiled else [m for m in gm.modules() if isinstance(m, GradBuckets)]
            out[attr] = self._buckets_of[attr]
        return out

    def _graph_values(self, run: ModeGraph, flat: list[Any]) -> list[Any]:
        """The graph's inputs in order: each parameter's local leaf, buffers, constants, the user's."""
        readers = self._readers.get(run.attr)
        if readers is None:  # where each input is read from, found once per graph (host time per call)
            readers = self._readers[run.attr] = [self._reader(run, *graph_input) for graph_input in run.inputs]
        user = iter(flat)
        values = []
        for kind, table, key, fqn in readers:
            if kind == "user":
                values.append(next(user))
            elif kind == "param":  # the graph runs on the local shard; its gradient comes back a DTensor
                param = table[key]
                values.append(self._leaves[fqn].get() if isinstance(param, DTensor) else param)
            else:
                values.append(table[key])
        return values

    def _reader(self, run: ModeGraph, name: str, kind: str, fqn: str | None) -> tuple[str, Any, str, str | None]:
        """(kind, the mapping that holds one graph input, its key there, its FQN): a parameter's or
        buffer's owning submodule's ``_parameters`` or ``_buffers``, or the traced constants."""
        if kind not in ("param", "buffer"):
            return ("constant", run.traced.constants, name, None) if kind == "constant" else ("user", None, name, None)
        assert fqn is not None
        *path, leaf = fqn.split(".")
        owner = self.module
        for part in path:
            owner = owner._modules[part]
        return kind, owner._parameters if kind == "param" else owner._buffers, leaf, fqn

    def _run_graph(self, values: list[Any], run: ModeGraph, settle: Callable[[], None]) -> Any:
        """The graph of ``run``'s mode on ``values``: inductor's compiled graph under
        ``compiler="inductor"`` (the compiled mode's graph, whose collectives are its own: the data
        check settles first; the other mode's runs op by op), else op by op, outside any user's
        ``torch.compile`` (``autopar.runtime.compiled``)."""
        if self._compiled_graph is not None and run.attr == "graph_module" and not under_autocast(self._check_device):
            settle()
            return self._compiled_graph(*values)
        if torch.compiler.is_compiling():
            warn_not_compiled()
        return run_eager(getattr(self, run.attr), values, self._offloader)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The parameters under the model's own names, as ``state_dict()`` and the eager model's
        ``named_parameters()`` name them (so optimizer state, DCP's ``get_state_dict`` and
        logging by name line up with eager's)."""
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The buffers (this rank's shards) under the model's own names."""
        return self.module.named_buffers(prefix, recurse, remove_duplicate)

    def _fqn_modifiers(self) -> dict[str, str]:
        """For ``torch.distributed.checkpoint.state_dict`` (``get_state_dict(pm, optimizer)``):
        names leave out ``module.``, so each top-level name of the model is reached through
        ``self.module``."""
        return {name: "module" for name in self.module._modules}

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Copy whole tensors (a plain ``state_dict()``) or DTensors on ``device_mesh`` (a filled
        ``pm.state_dict()``) into this rank's shards."""
        if assign:
            raise ConfigError(
                "ParallelModule.load_state_dict copies into its shards; assign=True is not supported: call it without assign"
            )
        missing, unexpected = load_model_state_dict(self, state_dict, strict=strict)
        stale_model.stepped(self)  # the model passed to compile is behind it now
        return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)


def world_timeout() -> datetime.timedelta | None:
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
