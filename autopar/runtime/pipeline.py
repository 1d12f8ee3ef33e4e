"""The pipeline-parallel runtime: a ShardedModule whose stages run under a pipeline schedule.

Layout. Mesh axis 0 is cut into S equal groups of ranks; stage i runs on ranks
``plan.pipeline.stages[i].ranks``, which form the stage mesh ``(mesh[0] // S, *mesh[1:])``.
Each stage has its own process group per stage-mesh axis (the intra-stage collectives), and
the ranks at the same stage-mesh position in every stage form a *line* group: rank j of stage i
sends its activations to rank j of stage i + 1 over it. Since corresponding ranks hold
corresponding shards (any spec, Partial included), stage i + 1 receives exactly the local
tensor the unsplit graph would have handed on, and reshards it where the plan says.

Under Interleaved1F1B and ZBV a group runs ``virtual_stages`` model stages (round robin, or in
a V: ``ir.pipeline.group_of``), and the line group carries the sends between any two of them.

Passes. The graph traced at one microbatch is rewritten with the usual passes for the stage
mesh (``default_passes`` over this rank's stage groups; checkpoint segments where the plan's
``memory`` has them), reduced to the loss (``passes.split.return_only``), then cut by
``passes.split`` into one submodule per model stage. Each rank runs only its group's
submodules, each through a ``_StageModule`` that holds the stage's parameter shards (in the
precision policy's stored dtype), takes the tensors the previous stage sends, and sends on what
later stages read (values a stage does not read itself pass through it).

A call. ``pm(*batch)`` runs one whole training step under ``torch.distributed.pipelining``
(``Schedule1F1B``, or ``ScheduleGPipe`` when there are fewer microbatches than stages, or
``ScheduleInterleaved1F1B`` / ``ScheduleZBVZeroBubble``): the forward and backward of every
microbatch. Autograd cannot span the schedule, which runs the backward itself, so the gradients
are held back: the call returns the model's outputs with the loss (whole-batch mean, the mean of
the microbatch means, each weighted by its count of targets where the loss is a cross entropy
that ignores some: ``autopar.runtime.microbatch_loss``; broadcast from the stage that computes
it to every rank) in place and
None for every other output, the loss a tensor whose
``backward()`` adds the held gradients, times the incoming gradient, into ``.grad``. So
``loss = pm(*batch); loss.backward(); opt.step()`` works as with the model itself: a call whose
loss gets no backward leaves ``.grad`` alone, and a second backward of the same loss is
autograd's usual error. Under ``torch.no_grad()`` only the forward runs (under ZBV, which has no
forward-only mode, the whole step, its gradients dropped). A parameter used by
several stages (tied embeddings) is held by each of them, and its gradient is summed over them.

Checkpoints. ``pm.state_dict()`` holds, under the model's own names, a DTensor (over the stage
mesh, with the plan's placements, sharing the shard) for each tensor this rank's stages hold;
over all ranks, the whole model. DCP puts the parts together, so ``autopar.checkpoint.save`` /
``load`` move a model and its optimizer between pipeline layouts and plans without a pipeline.
A stage's optimizer steps a part of the model: its param groups are saved with the whole
model's names (gathered from every stage). ``init=SeededInit(...)`` / ``FromCheckpoint(...)``
materialize only the shards this rank's stages hold.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
import torch.utils._pytree as pytree
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor

from autopar.errors import ConfigError, DataMismatchError, ModelError, PlanError, UsageError
from autopar.ir.data import DataLayout
from autopar.ir.pipeline import group_of, stage_mesh_of, stage_ranks
from autopar.ir.plan import Plan
from autopar.ir.spec import local_shape
from autopar.passes import default_passes, run_passes
from autopar.passes.held import HeldChains, direct_sync
from autopar.passes.split import return_only, split_into_stages, stage_io, stage_submodule, stage_wiring
from autopar.runtime import stale_model
from autopar.runtime.attribute_guard import AttributeGuard
from autopar.runtime.base import ShardedModule, attach, model_tensors
from autopar.runtime.checkpoint import device_mesh, load_model_state_dict
from autopar.runtime.data import RandomOps, random_ops, start_check
from autopar.runtime.held_sync import Held, HeldReducer, HeldSyncStage, sum_in
from autopar.runtime.hook_guard import HookGuard
from autopar.runtime.materialize import FromCheckpoint, SeededInit, checkpoint_shards, seeded_shards
from autopar.runtime.microbatch_loss import label_counts
from autopar.runtime.model_view import ModelAttributes, model_view
from autopar.runtime.modes import describe_mode, frozen_parameters, mode_key, unfrozen
from autopar.runtime.module import world_timeout
from autopar.trace import TracedModel, requires_grad

log = logging.getLogger("autopar")


def pipeline_groups(mesh_shape: tuple[int, ...], num_stages: int):
    """This rank's (stage index, stage-mesh axis group names, stage-mesh coordinate, line group).

    Every rank creates every group, in the same order, with the default group's timeout."""
    stage_mesh = (mesh_shape[0] // num_stages, *mesh_shape[1:])
    ranks = torch.arange(math.prod(mesh_shape)).reshape(num_stages, *stage_mesh)
    timeout = world_timeout()
    names = []
    for axis, size in enumerate(stage_mesh):
        members = ranks.movedim(axis + 1, -1).reshape(-1, size).tolist()
        group, _ = dist.new_subgroups_by_enumeration(members, timeout=timeout)
        names.append(group.group_name)
    lines = ranks.reshape(num_stages, -1).T.tolist()
    line, _ = dist.new_subgroups_by_enumeration(lines, timeout=timeout)
    position = [int(i) for i in torch.unravel_index(torch.tensor(dist.get_rank()), (num_stages, *stage_mesh))]
    return position[0], tuple(names), tuple(position[1:]), line


def _microbatch_loss(output: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The last stage returns the microbatch's loss; the schedule's "target" is its weight (1, or
    by its count of targets: ``autopar.runtime.microbatch_loss``)."""
    return output * weight.reshape(()).to(output.dtype)


class _StageModule(torch.nn.Module):
    """One stage: its submodule, parameter shards, and the names it receives and sends."""

    def __init__(
        self,
        submod: torch.fx.GraphModule,
        inputs: list[str],
        outputs: list[str],
        received: list[str],
        sent: list[str] | None,
        loss_name: str,
        user_keys: dict[str, str],
        tensors: dict[str, torch.Tensor],
        constants: set[str],
        held: HeldChains,
    ):
        super().__init__()
        self.submod = submod
        self._inputs, self._outputs, self._received, self._sent = inputs, outputs, received, sent
        self._loss_name, self._user_keys = loss_name, user_keys  # schedule kwarg key → placeholder
        # the held chains this stage reads (``passes.held``), and their values for this step (``start_step``)
        self._chains = {name: held.chains[name] for name in inputs if name in held.chains}
        self._syncs = {name: direct_sync(chain) for name, (_, chain) in self._chains.items()}
        self.step_values: dict[str, torch.Tensor] = {}
        self.reducer: HeldReducer | None = None  # this step's, while the schedule runs
        sources = {source for source, _ in self._chains.values()}
        self.held = torch.nn.Module()
        self._held_names: list[str] = []
        self._constants: dict[str, torch.Tensor] = {}
        for name, value in tensors.items():
            if name not in inputs and name not in sources:
                continue
            if isinstance(value, torch.nn.Parameter):
                self.held.register_parameter(name, value)
            elif name in constants:
                self._constants[name] = value
            else:
                self.held.register_buffer(name, value)
            self._held_names.append(name)

    def start_step(self, train: bool, made: dict[str, Held]) -> None:
        """Run this stage's held chains for a step: every microbatch reads a detached leaf of
        each value, whose gradient sums theirs (``runtime.held_sync`` reduces it). ``made``: name →
        its ``Held``, shared by this rank's stages."""
        self.step_values = {}
        for name, (source, chain) in self._chains.items():
            if name not in made:
                param = getattr(self.held, source)
                with torch.set_grad_enabled(train):
                    value = chain(param)
                leaf = value.detach().requires_grad_(value.requires_grad)
                made[name] = Held(value, leaf, param, self._syncs[name])
                if value.requires_grad and value.dtype != param.dtype:
                    sum_in(leaf, param.dtype)
            self.step_values[name] = made[name].leaf

    def forward(self, *received: torch.Tensor, **user: Any) -> Any:
        env: dict[str, Any] = dict(zip(self._received, received))
        env.update((self._user_keys[key], value) for key, value in user.items())
        for name in self._held_names:
            env[name] = self._constants[name] if name in self._constants else getattr(self.held, name)
        env.update(self.step_values)
        outputs = self.submod(*[env[name] for name in self._inputs])
        env.update(zip(self._outputs, outputs))
        if self._sent is None:
            return env[self._loss_name]
        return tuple(env[name].contiguous() for name in self._sent)


class _HeldGradients(torch.autograd.Function):
    """The loss of a pipelined step; its backward hands out the gradients the schedule computed."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor, num_params: int, *grads_then_params: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*grads_then_params[:num_params])
        ctx.num_params = num_params
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        if torch.is_grad_enabled():  # create_graph=True: the schedule's gradients have no graph to follow
            raise UsageError(
                "a gradient of a gradient (torch.autograd.grad(..., create_graph=True), as a gradient penalty takes) "
                "through a pipelined module: its schedule ran the backward in the call, so the gradients it hands "
                "out have no graph and the penalty would not train, without a word. Compile without pipeline=, or "
                "compute the penalty outside the compiled module"
            )
        grads = ctx.saved_tensors
        held = [None if g is None else g * grad_loss.to(g.dtype) for g in grads]
        return (None, None, *([None] * ctx.num_params), *held)


def compile_pipeline(
    model: torch.nn.Module, traced: TracedModel, plan: Plan, init: SeededInit | FromCheckpoint | None = None
) -> PipelineParallelModule:
    """Rewrite and split ``traced`` (one microbatch) by ``plan`` and return this rank's module.

    ``init`` (None: cut from ``model``'s tensors) makes the shards of this rank's stages only;
    under ``FromCheckpoint`` they are empty until ``autopar.checkpoint.load`` fills them."""
    stages = plan.pipeline
    assert stages is not None
    groups_ranks = stage_ranks(plan.mesh_shape, stages.num_stages)
    expected = (
        stage_mesh_of(plan.mesh_shape, stages.num_stages),
        [groups_ranks[group_of(stages.schedule, stages.num_stages, j)] for j in range(stages.num_model_stages)],
    )
    if (tuple(stages.stage_mesh), [tuple(s.ranks) for s in stages.stages]) != expected:
        raise PlanError(
            f"the plan's pipeline puts its {stages.num_stages} stages on stage mesh {tuple(stages.stage_mesh)} and ranks "
            f"{[list(s.ranks) for s in stages.stages]}, but on mesh {tuple(plan.mesh_shape)} they are on "
            f"{expected[0]} and {[list(r) for r in expected[1]]} (mesh axis 0 cut into equal groups): re-plan"
        )
    stage_index, groups, coordinate, line = pipeline_groups(tuple(plan.mesh_shape), stages.num_stages)
    stage_view = _stage_view(plan)
    position, _ = loss_output(traced)
    # ZBV computes weight gradients for the stage modules' parameters only: its graphs keep the syncs.
    params = frozenset(gi.name for gi in traced.inputs if gi.kind == "param")
    held = HeldChains(params, gathers=stages.hold_gathered) if stages.schedule != "ZBV" else None
    passes = [
        *default_passes(groups, held=held),
        functools.partial(return_only, position=position),
        functools.partial(split_into_stages, stages=stages),
    ]
    split = run_passes(copy.deepcopy(traced.gm), stage_view, passes)
    log.info(
        "autopar: rank %d runs pipeline stage %d of %d on stage mesh %s at %s",
        dist.get_rank(),
        stage_index,
        stages.num_stages,
        tuple(stages.stage_mesh),
        coordinate,
    )
    return PipelineParallelModule(model, traced, split, plan, stage_index, groups, coordinate, line, init, held)


def _stage_view(plan: Plan) -> Plan:
    """The plan as the passes read it: the intra-stage decisions on the stage mesh."""
    return dataclasses.replace(plan, mesh_shape=tuple(plan.pipeline.stage_mesh), pipeline=None, stats={})


class PipelineParallelModule(ModelAttributes, ShardedModule):
    """The sibling of ParallelModule for a pipelined plan (see the module docstring for what a call does).

    ``pm.module`` holds this rank's stage's shards under the model's names; ``pm.graph`` is the
    graph this rank runs (its stage) and ``pm.graph_module`` the split graph of every stage.
    ``full_state_dict()`` and ``full_grads()`` gather over the stage mesh and across stages;
    ``state_dict()`` is this rank's part of the model, as DTensors (DCP).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        traced: TracedModel,
        split: torch.fx.GraphModule,
        plan: Plan,
        stage_index: int,
        groups: tuple[str, ...],
        coordinate: tuple[int, ...],
        line: dist.ProcessGroup,
        init: SeededInit | FromCheckpoint | None = None,
        held: HeldChains | None = None,
    ):
        stages = plan.pipeline
        # Offloading is not combined with pipelines yet: no offloader.
        super().__init__(
            model, traced, split, plan, groups, coordinate, tuple(stages.stage_mesh), num_microbatches=stages.num_microbatches
        )
        self._stage_index = stage_index  # this rank's group: mesh axis 0 cut into num_stages
        self._num_stages = stages.num_stages
        self._num_model_stages = stages.num_model_stages
        self._group_of = [group_of(stages.schedule, stages.num_stages, j) for j in range(stages.num_model_stages)]
        self._chunks = [j for j, group in enumerate(self._group_of) if group == stage_index]
        self._num_microbatches = stages.num_microbatches
        self._line = line
        self._loss_position, loss_node = loss_output(traced)
        self._param_canonicals = {traced.ties.get(gi.fqn, gi.fqn) for gi in traced.inputs if gi.kind == "param"}
        self._held_chains = held if held is not None else HeldChains(frozenset())
        tensors = self._hold_tensors(model, split, init)
        users = [gi.name for gi in traced.inputs if gi.kind == "user"]
        # The schedule takes the user inputs as keyword arguments, which must not meet its own
        # (target, losses, ...): they go under neutral keys.
        self._user_keys = {f"input_{i}": name for i, name in enumerate(users)}
        self._device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        self._whole_batch = DataLayout("whole", (), (dist.get_world_size(),))  # what every rank passes (``_agreed_inputs``)
        self._loss_dtype = loss_node.meta["val"].dtype
        self._label_counts = label_counts(traced, loss_node)  # refuses a loss summed over its targets
        self._schedule = self._make_schedule(split, loss_node, tensors)
        self._random = self._stage_random_ops(traced, plan, coordinate)
        self._hook_guard = HookGuard.install(self.module)  # a hook added after compile would not run: refused
        self._attribute_guard = AttributeGuard(self, self.module, model, traced.reads)  # nor would an attribute set
        self._traced_mode = mode_key(model.training, model.named_modules())  # each module's, as the graph ran them
        self._frozen = frozen_parameters(self.module)  # one unfrozen later is refused: no graph trains it

    def _gathers(self) -> bool:
        """The whole state needs every stage (a broadcast from the one that holds each tensor)."""
        return True

    def _holder(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model's own classes hold this stage's shards (``runtime.model_view``), as ParallelModule's."""
        return model_view(model, self)

    def _hold_tensors(self, model: torch.nn.Module, split: torch.fx.GraphModule, init) -> dict[str, torch.Tensor]:
        """Attach this stage's shards to ``self.module``; return placeholder name → tensor.

        A stage holds the parameters and buffers its submodule reads; a tensor read by several
        stages (tied embeddings) is held by each (``self._holders``: canonical FQN → stages).
        The shards come from ``init``, or are cut from ``model``'s tensors."""
        traced = self._traced
        full = model_tensors(model)
        readers: dict[str, set[int]] = {}
        for index in range(self._num_model_stages):
            for name in stage_io(split, index)[0]:  # a held chain's value is its parameter's read
                readers.setdefault(self._held_chains.source(name), set()).add(self._group_of[index])
        self._holders: dict[str, set[int]] = {}
        for gi in traced.inputs:
            if gi.kind in ("param", "buffer"):
                canonical = traced.ties.get(gi.fqn, gi.fqn)
                self._holders.setdefault(canonical, set()).update(readers.get(gi.name, set()))
        for holders in self._holders.values():
            if not holders:
                holders.add(0)  # read by no stage: the first stage keeps it, for full_state_dict
        initial = self._initial_shards(model, init)
        tensors: dict[str, torch.Tensor] = {}
        made: dict[str, torch.Tensor] = {}
        # Stored in the placeholder's dtype: the model's own, or a precision policy's master dtype.
        dtypes = {
            n.name: n.meta["val"].dtype
            for n in traced.gm.graph.nodes
            if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
        }
        for gi in traced.inputs:
            if gi.kind == "constant":
                tensors[gi.name] = self._constants[gi.name]
                continue
            if gi.kind not in ("param", "buffer"):
                continue
            canonical = traced.ties.get(gi.fqn, gi.fqn)
            if self._stage_index not in self._holders[canonical]:
                continue
            if canonical not in made:
                source = initial[gi.fqn] if initial is not None else self._cut(gi.fqn, full[gi.fqn])
                local = source.to(dtypes.get(gi.name, full[gi.fqn].dtype), copy=True)
                if gi.kind == "param":
                    made[canonical] = torch.nn.Parameter(local, requires_grad=full[gi.fqn].requires_grad)
                else:
                    made[canonical] = local
            attach(self.module, gi.fqn, made[canonical], gi.kind)
            tensors[gi.name] = made[canonical]
        return tensors

    def _initial_shards(self, model: torch.nn.Module, init) -> dict[str, torch.Tensor] | None:
        """FQN → this rank's shard of each tensor its stages hold, made by ``init`` (None: cut
        them from the model). ``SeededInit`` still runs every module's init, in order, so each
        stage gets its shards of the same numbers as ``init.apply`` on the whole model."""
        if init is None:
            return None
        specs = {
            gi.fqn: self._plan.params[gi.fqn]
            for gi in self._traced.inputs
            if gi.kind in ("param", "buffer") and self._stage_index in self._holders[self._traced.ties.get(gi.fqn, gi.fqn)]
        }
        if isinstance(init, SeededInit):
            return seeded_shards(model, init, specs, self._coordinate, self._mesh_shape)
        return checkpoint_shards(model, init, specs, self._coordinate, self._mesh_shape)  # load fills them

    def _make_schedule(self, split: torch.fx.GraphModule, loss_node: torch.fx.Node, tensors: dict[str, torch.Tensor]):
        """This rank's stage modules (one per model stage its group runs), their ``PipelineStage``s
        (static shapes) and the schedule."""
        traced, plan = self._traced, self._plan
        # The name the loss has in the rewritten graph: a collective may follow the traced loss
        # node (an all-reduce of a batch-split loss, on a stage mesh of several devices).
        loss_name = _returned_name(split)
        count = self._num_model_stages
        sent = stage_wiring(split, {gi.name for gi in traced.inputs} | set(self._held_chains.chains), loss_name, count)
        nodes = {n.name: n for n in traced.gm.graph.nodes}
        # A value an outlined (checkpointed) segment hands on is a getitem standing for a traced node.
        for i in range(count):
            for n in stage_submodule(split, i).graph.nodes:
                origin = n.meta.get("autopar", {}).get("outlined_from")
                if origin is not None:
                    nodes[n.name] = nodes[origin]
        self._stages = torch.nn.ModuleList()
        pipeline_stages = []
        for index in self._chunks:
            received = sent[index - 1] if index else []
            is_last = index == count - 1
            inputs, outputs = stage_io(split, index)
            module = _StageModule(
                stage_submodule(split, index),
                inputs,
                outputs,
                received,
                None if is_last else sent[index],
                loss_name,
                self._user_keys,
                tensors,
                constants=set(self._constants),
                held=self._held_chains,
            )
            self._stages.append(module)
            # Static shapes: torch's pipelining would otherwise infer them by running a microbatch
            # through every stage first, on uninitialized tensors.
            example_in = tuple(self._example(nodes[name], plan) for name in received)
            if is_last:
                example_out = (torch.empty((), dtype=self._loss_dtype, device=self._device).requires_grad_(True),)
            else:
                example_out = tuple(self._example(nodes[name], plan) for name in sent[index])
            pipeline_stages.append(
                HeldSyncStage(
                    module, index, count, self._device, input_args=example_in, output_args=example_out, group=self._line
                )
            )
        self._pipeline_stage = pipeline_stages[0]
        # The gradients are the sum over microbatches; ``forward`` divides them by their number
        # once (the model's loss is a mean over its microbatch, the whole batch's the mean of
        # those means). torch's scale_grads would divide per stage, twice for a parameter that two
        # stages of one rank share (a tied embedding and head, both on group 0 under ZBV).
        schedule = _SCHEDULES[plan.pipeline.schedule]
        stages_arg = pipeline_stages if plan.pipeline.virtual_stages > 1 else pipeline_stages[0]
        return schedule(stages_arg, self._num_microbatches, loss_fn=_microbatch_loss, scale_grads=False)

    def _stage_random_ops(self, traced: TracedModel, plan: Plan, coordinate: tuple[int, ...]) -> RandomOps | None:
        """The random ops of this rank's stages that draw for a tensor replicated on a stage-mesh
        axis (``runtime.data.random_ops``): the ranks of this stage group that hold it must draw
        alike. Groups of other stages never compare with this one's (their ``group`` is offset)."""
        names = {name for j in self._chunks for name in plan.pipeline.stages[j].nodes}
        found = random_ops(traced.gm, _stage_view(plan), coordinate, only=names)
        if found is None:
            return None
        return found._replace(group=found.group + self._stage_index * math.prod(plan.pipeline.stage_mesh))

    def _example(self, node: torch.fx.Node, plan: Plan) -> torch.Tensor:
        val = node.meta.get("val")
        decision = plan.nodes.get(node.name)
        if not isinstance(val, torch.Tensor) or decision is None:
            raise PlanError(f"pipeline stages may only pass single tensors, but {node.format_node()} crosses a cut")
        shape = local_shape(decision.shapes[0], decision.outs[0], self._mesh_shape)
        grad = requires_grad(node) and (val.is_floating_point() or val.is_complex())
        return torch.empty(shape, dtype=val.dtype, device=self._device).requires_grad_(grad)

    @property
    def graph(self) -> torch.fx.Graph:
        """The graph this rank runs: its stage's submodule."""
        return stage_submodule(self.graph_module, self._chunks[0]).graph

    @property
    def stage_index(self) -> int:
        return self._stage_index

    def __deepcopy__(self, memo: dict) -> Any:
        raise UsageError(
            "copy.deepcopy of a pipelined module (torch.optim.swa_utils.AveragedModel makes one of pm or pm.module): "
            "its schedule holds process groups no copy can share. Average the weights yourself: avg = "
            "[p.detach().clone() for p in pm.parameters()], then torch._foreach_lerp_(avg, [p.detach() for p in "
            "pm.parameters()], 1 - decay) after each step, and copy them in under torch.no_grad() to evaluate (each "
            "rank averages its stage's parameters); or compile without pipeline=, where AveragedModel(pm) runs"
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._hook_guard.check()
        self._attribute_guard.check()
        if not self.training:
            raise UsageError(
                "this pipelined module is in eval mode, but it runs only the graph traced in train mode (batch norm "
                "with batch statistics, dropout on), so its outputs would not be the model's eval outputs: call "
                "pm.train() (under torch.no_grad() it runs forward only), or evaluate with a module compiled without "
                "a pipeline (pipeline='off')"
            )
        shells = list(self.module.named_modules())
        stale_model.check_modes(self, tuple(module.training for _, module in shells))
        mode = mode_key(self.training, shells)
        if mode.odd != self._traced_mode.odd:
            raise UsageError(
                f"this pipelined module runs only the graph traced with its modules' modes as they were at compile "
                f"({describe_mode(self._traced_mode)} mode), but this call is in {describe_mode(mode)} mode, which "
                "eager would run otherwise: set the modules back (pm.train()), set their modes on the model before "
                "autopar.compile, or compile without a pipeline (pipeline='off'), whose module traces each mode"
            )
        flat = self._agreed_inputs(args, kwargs)
        user = dict(zip(self._user_keys, flat))
        params = [p for p in self._stages.parameters() if p.requires_grad]
        train = torch.is_grad_enabled() and bool(params)
        M = self._num_microbatches
        # Each microbatch's loss weight (every rank computes them, so that a refusal is everyone's).
        weights = self._label_counts.weights(flat, M) if self._label_counts is not None else [1.0] * M
        target = torch.tensor(weights, dtype=torch.float64) if self._holds_loss else None
        losses: list[torch.Tensor] = []
        if not train and self._plan.pipeline.schedule == "ZBV" and params:
            # torch's ZBV has no forward-only mode (its action list splits every backward): run the
            # whole step and drop its gradients.
            with torch.enable_grad():
                loss = self.forward(*args, **kwargs)
            return pytree.tree_map(lambda value: value.detach() if isinstance(value, torch.Tensor) else value, loss)
        made: dict[str, Held] = {}
        for module in self._stages:
            module.start_step(train, made)
        if not train:
            # schedule.eval() with return_outputs=False: merging the per-microbatch losses by
            # concatenation, which eval() would do, fails on scalars (and is not needed).
            self._schedule._has_backward = False
            try:
                self._schedule.step(target=target, losses=losses, return_outputs=False, **user)
            finally:
                self._schedule._has_backward = True
            return self._outputs(self._broadcast_loss(losses))
        saved = [p.grad for p in params]
        for p in params:
            p.grad = None
        readers = {name: [m for m in self._stages if name in m.step_values] for name in made}
        reducer = HeldReducer(made, readers)
        try:
            for module in self._stages:
                module.reducer = reducer
            self._schedule.step(target=target, losses=losses, return_outputs=False, **user)
            reducer.finish()
            for p in params:
                if p.grad is not None:
                    p.grad.div_(self._num_microbatches)
            self._sum_shared_grads()
            held = [p.grad for p in params]
        finally:
            for module in self._stages:
                module.reducer = None
            for p, grad in zip(params, saved):
                p.grad = grad
        loss = self._broadcast_loss(losses)
        return self._outputs(_HeldGradients.apply(loss, len(params), *held, *params))

    def _agreed_inputs(self, args: tuple, kwargs: dict) -> list[Any]:
        """The call's flat inputs, once every rank has passed the same whole batch and the ranks
        that must draw alike have random generators in step (one small all-gather,
        ``runtime.data``; waited for here, as a step's stages exchange activations from the start):
        the first stage reads the inputs and the last the labels, each on its own ranks, so other
        data on one rank would pair one rank's inputs with another's labels."""
        leaves = pytree.tree_leaves((args, kwargs))

        def validate() -> list[Any]:
            self._check_unfrozen()
            return self._user_inputs(args, kwargs)

        flat, settle = start_check(validate, leaves, self._whole_batch, (0,), self._device, self._random)
        try:
            settle()
        except DataMismatchError as error:
            raise DataMismatchError(
                f"ranks {error.ranks[0]} and {error.ranks[1]} passed different batches, but a pipelined module takes "
                "the same whole batch on every rank (its first stage reads the inputs and its last the labels, on "
                "their own ranks): pass every rank the same batch",
                error.ranks,
            ) from None
        return flat

    def _check_unfrozen(self) -> None:
        """A ``ModelError`` (which every rank raises, ``runtime.data``: the parameter is one
        stage's) where a parameter frozen at compile trains now: no stage graph trains it."""
        thawed = unfrozen(self._frozen)
        if thawed:
            raise ModelError(
                f"parameters {sorted(thawed)} were frozen (requires_grad=False) when the model was compiled and are "
                "trained now, but a pipelined module runs only the graphs traced then, which compute no gradient "
                "for them: unfreeze them before autopar.compile (freezing a parameter after compile is fine), or "
                "compile without a pipeline (pipeline='off'), whose module traces a graph that trains them"
            )

    @property
    def _holds_loss(self) -> bool:
        """Whether this rank's group runs the last model stage (the last group, or under ZBV the first)."""
        return self._group_of[-1] == self._stage_index

    def _outputs(self, loss: torch.Tensor) -> Any:
        """The model's outputs with the loss in its place and None for the others (logits):
        they exist per microbatch on the last stage only, and a pipelined call returns the loss."""
        leaves: list[Any] = [None] * self._traced.out_spec.num_leaves
        leaves[self._loss_position] = loss
        return pytree.tree_unflatten(leaves, self._traced.out_spec)

    def _broadcast_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        if self._holds_loss:
            loss = torch.stack([l.detach() for l in losses]).mean().to(self._device)
        else:
            loss = torch.empty((), dtype=self._loss_dtype, device=self._device)
        dist.broadcast(loss, group=self._line, group_src=self._group_of[-1])
        return loss

    def _sum_shared_grads(self) -> None:
        """Sum the gradients of tensors held by several stages (tied embeddings) over those stages."""
        for canonical in sorted(self._holders):
            holders = self._holders[canonical]
            if len(holders) < 2 or canonical not in self._param_canonicals:
                continue
            if self._stage_index in holders:
                param = self._local(canonical)
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                grad = param.grad
            else:
                shape = local_shape(self._full_shapes[canonical], self._plan.params[canonical], self._mesh_shape)
                grad = torch.zeros(shape, dtype=self._full_dtypes[canonical], device=self._device)
            dist.all_reduce(grad, group=self._line)

    def _owner(self, fqn: str) -> int:
        return min(self._holders[self._traced.ties.get(fqn, fqn)])

    def _contributes(self, fqn: str) -> bool:
        return self._stage_index == self._owner(fqn)

    def _gather(self, fqn: str, local: torch.Tensor | None) -> torch.Tensor | None:
        """The whole tensor ``fqn`` on every rank: gathered in its owner stage, broadcast along the line."""
        owner = self._owner(fqn)
        flag = torch.zeros((), dtype=torch.int64, device=self._device)
        full = None
        if self._stage_index == owner:
            flag.fill_(int(local is not None))
            if local is not None:
                full = super()._gather(fqn, local).contiguous()
        dist.broadcast(flag, group=self._line, group_src=owner)
        if not flag.item():
            return None
        if full is None:
            full = torch.empty(self._full_shapes[fqn], dtype=self._full_dtypes[fqn], device=self._device)
        dist.broadcast(full, group=self._line, group_src=owner)
        return full

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """This rank's stages' parameters under the model's own names (as ``state_dict()``)."""
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """This rank's stages' buffers under the model's own names."""
        return self.module.named_buffers(prefix, recurse, remove_duplicate)

    # -- checkpoints ------------------------------------------------------------------------------

    @property
    def device_mesh(self) -> Any:
        """A ``DeviceMesh`` over this rank's stage mesh (its stage's ranks, autopar's groups)."""
        if self._device_mesh is None:
            ranks = stage_ranks(self._plan.mesh_shape, self._num_stages)[self._stage_index]
            self._device_mesh = device_mesh(self._mesh_shape, self._groups, list(ranks))
        return self._device_mesh

    def _holds(self, fqn: str) -> bool:
        return self._stage_index in self._holders.get(self._traced.ties.get(fqn, fqn), ())

    def local_state_keys(self) -> list[str]:
        """The ``state_dict()`` names this rank's stages hold (a tied name where either is held)."""
        return [fqn for fqn in self._state_keys if self._holds(fqn)]

    def whole_param_names(self, groups: list[list[str]]) -> list[list[str]]:
        """Each optimizer param group's FQNs over the whole model: the union of every rank's
        group (one all-gather over the world), in the order of the model's parameters (that of
        ``pm.parameters()`` on a module without a pipeline)."""
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, [list(names) for names in groups])
        counts = sorted({len(rank_groups) for rank_groups in gathered})
        if len(counts) > 1:
            raise ConfigError(
                f"the optimizers of the pipeline's ranks have different numbers of param groups ({counts}): build "
                "each rank's optimizer with the same groups (a group may be empty on a stage that holds none of it)"
            )
        order: dict[str, int] = {}  # a tied parameter at its first name's place, as pm.parameters() has it
        for gi in self._traced.inputs:
            order.setdefault(self._traced.ties.get(gi.fqn, gi.fqn), len(order))
        return [
            sorted(
                {name for rank_groups in gathered for name in rank_groups[index]},
                key=lambda name: order.get(self._traced.ties.get(name, name), len(order)),
            )
            for index in range(len(groups))
        ]

    def local_params_of(self, names: list[str]) -> list[str]:
        """Of a param group's FQNs over the whole model, those this rank's stages hold."""
        return [name for name in names if self._holds(name)]

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False) -> Any:
        """Copy whole tensors (a plain ``state_dict()``) or DTensors on ``device_mesh`` (a filled
        ``pm.state_dict()``) into this rank's shards; ``strict`` asks for every name of the model."""
        if assign:
            raise ConfigError("load_state_dict copies into the shards; assign=True is not supported: call it without assign")
        part = isinstance(next(iter(state_dict.values()), None), DTensor)  # this rank's part only
        missing = [k for k in self._state_keys if k not in state_dict and (self._holds(k) or not part)]
        unexpected = [k for k in state_dict if k not in set(self._state_keys)]
        if strict and (missing or unexpected):
            raise RuntimeError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        load_model_state_dict(self, state_dict, strict=False)
        stale_model.stepped(self)  # the model passed to compile is behind it now
        return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)


def _returned_name(split: torch.fx.GraphModule) -> str:
    """The original node name of the one value the split graph returns (``getitem`` of a stage's
    outputs)."""
    output = next(n for n in split.graph.nodes if n.op == "output")
    (value,) = pytree.tree_leaves(output.args[0])
    submodule, position = value.args
    index = int(str(submodule.target).removeprefix("submod_"))
    return stage_io(split, index)[1][position]


_SCHEDULES = {
    "1F1B": Schedule1F1B,
    "GPipe": ScheduleGPipe,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
    "ZBV": ScheduleZBVZeroBubble,
}


def loss_output(traced: TracedModel) -> tuple[int, torch.fx.Node]:
    """(position among the flat outputs, node) of the loss: the one scalar floating output. A
    Hugging Face causal LM returns the loss and the logits: the loss is the scalar one."""
    output = next(n for n in traced.gm.graph.nodes if n.op == "output")
    results = pytree.tree_leaves(output.args[0])
    scalars = [i for i, r in enumerate(results) if isinstance(r, torch.fx.Node) and _is_scalar(r)]
    if len(scalars) != 1:
        raise ModelError(
            "a pipelined model must return its loss, one scalar floating tensor (the last stage's output), among "
            f"its outputs: this model returns {len(results)} values, of which {len(scalars)} are scalars; compute the "
            "loss inside forward (GPT(..)(idx, targets), or labels= for a Hugging Face model)"
        )
    return scalars[0], results[scalars[0]]


def _is_scalar(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() == 0 and val.is_floating_point()
