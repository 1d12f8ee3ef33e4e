"""Trace a model to an ATen-level ``torch.fx`` graph with FakeTensor shapes.

``torch.export.export(..., strict=False)`` gives the training IR: ATen ops that keep composite
ops such as ``linear``, ``layer_norm``, ``scaled_dot_product_attention``, ``embedding``,
``cross_entropy_loss``, ``conv2d`` and ``batch_norm`` whole, so that each stays one sharding
decision. Parameters, buffers and lifted constants become placeholders, which we map back to
their fully qualified names (FQNs). Every node carries its FakeTensor in ``node.meta["val"]``.
"""

from __future__ import annotations

import contextlib
import hashlib
import operator
import re
import time
import types
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import is_fake
from torch.export.graph_signature import InputKind
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils._pytree import TreeSpec

from autopar.errors import ConfigTypeError, TraceError
from autopar.ir.options import MixedPrecision, to_dtype
from autopar.trace.aliases import independent_inputs
from autopar.trace.attention import causal_attention, causal_for_the_example, written
from autopar.trace.checkpoints import model_checkpoints
from autopar.trace.fake import fake_tensors, has_meta_tensors
from autopar.trace.functions import functions_as_one_op
from autopar.trace.hooks import check_hooks
from autopar.trace.host_random import export_checking_host_draws
from autopar.trace.moe import experts_as_one_op
from autopar.trace.reads import GUARDED, Reads, model_reads

# Runtime shape and dtype assertions that export leaves behind; after sharding they would
# check local tensors against global shapes, and they decide nothing, so they are dropped.
_ASSERTION_OPS = {
    torch.ops.aten._assert_tensor_metadata.default,
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
}


@dataclass(frozen=True, slots=True)
class GraphInput:
    """A placeholder of the traced graph: a parameter, buffer, lifted constant or user input."""

    name: str
    kind: str  # "param" | "buffer" | "constant" | "user"
    fqn: str | None


@dataclass(frozen=True)
class TracedModel:
    gm: torch.fx.GraphModule
    inputs: tuple[GraphInput, ...]
    in_spec: TreeSpec
    out_spec: TreeSpec
    ties: dict[str, str] = field(default_factory=dict)  # FQN → canonical FQN of the same tensor
    constants: dict[str, torch.Tensor] = field(default_factory=dict)  # placeholder → value
    graph_hash: str = ""
    # What tracing changed about the model's behaviour, for the plan's notes (a cache dropped).
    notes: tuple[str, ...] = ()
    # Wall seconds tracing took: planning's time before the solver, which sizes the solver's
    # optional work (``sharding._solve_budgeted``).
    trace_s: float = 0.0
    # The checkpoint policy the model's own torch.utils.checkpoint calls ask for, None if none, and
    # the FQNs of the modules they ran (() where unknown: every layer) (``trace.checkpoints``): the
    # planner's where ``checkpointing=`` leaves it open.
    checkpointing: str | None = None
    checkpointed: tuple[str, ...] = ()
    # (module FQN, name, value) of each plain attribute forward read (a scalar, or a tensor that is
    # neither parameter nor buffer), as the graph holds it (``trace.reads``; ``runtime.attribute_guard``
    # refuses a call after one changed).
    reads: tuple[tuple[str, str, Any], ...] = ()
    # (module FQN, name) of each plain attribute forward read before setting it: state one call
    # leaves to the next (a counter), which the graph holds at its traced value (``trace.reads``)
    carried: tuple[tuple[str, str], ...] = ()
    # (module FQN, name) of each other plain attribute forward sets, which a compiled call does not
    sets: tuple[tuple[str, str], ...] = ()

    def placeholders(self, kind: str) -> list[GraphInput]:
        return [i for i in self.inputs if i.kind == kind]

    def node(self, name: str) -> torch.fx.Node:
        for node in self.gm.graph.nodes:
            if node.name == name:
                return node
        raise KeyError(name)


_KINDS = {
    InputKind.PARAMETER: "param",
    InputKind.BUFFER: "buffer",
    InputKind.CONSTANT_TENSOR: "constant",
    InputKind.USER_INPUT: "user",
}


def trace(
    model: torch.nn.Module,
    example_inputs: tuple[Any, ...] = (),
    example_kwargs: dict[str, Any] | None = None,
    precision: MixedPrecision | None = None,
) -> TracedModel:
    """Export ``model`` called on the example inputs to an ATen graph.

    Under a ``precision`` policy with a ``param_dtype``, the model is traced as if its floating
    parameters were of that dtype (no copy is made), so activations take it as the model's own
    code decides (its explicit upcasts stay). Where the master weights are kept in another dtype
    (``precision.casts``), each such parameter placeholder holds the master dtype and feeds one
    cast to ``param_dtype`` at its first use, which every use reads (``_cast_parameters``).
    Floating example inputs are cast to ``param_dtype`` first, as the runtime casts each call's
    (``MixedPrecision.cast_inputs``)."""
    start = time.perf_counter()
    if not isinstance(model, torch.nn.Module):
        raise ConfigTypeError(f"autopar traces an nn.Module, got {type(model).__name__}")
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    if precision is not None:
        example_inputs, example_kwargs = precision.cast_inputs((example_inputs, example_kwargs))
    _refuse_cache_inputs(example_kwargs)
    # Inputs that share memory would be one placeholder for every call (``trace.aliases``).
    example_inputs, example_kwargs = independent_inputs(example_inputs, example_kwargs)
    check_hooks(model)
    try:
        # Stacked experts modules trace as one autopar::moe_experts op (``trace.moe``).
        with (
            _no_stack_traces(),
            _lazy_recompile(),
            experts_as_one_op(model),
            functions_as_one_op(),  # custom autograd Functions keep their backward (``trace.functions``)
            model_checkpoints(model) as checkpoints,  # the model's own torch.utils.checkpoint calls (``trace.checkpoints``)
            _no_caches(model) as notes,
            _sync_batch_norms_as_batch_norms(model, notes),
            model_reads(model) as read,  # the plain attributes forward reads (``trace.reads``)
            _fake_params(model, (example_inputs, example_kwargs or {}), precision),
        ):
            exported = export_checking_host_draws(  # Python's or NumPy's random numbers (``trace.host_random``)
                lambda: torch.export.export(model, example_inputs, example_kwargs or {}, strict=False), type(model).__name__
            )
    except TraceError:  # autopar's own refusal, raised while tracing (trace.functions): it names its fix
        raise
    except Exception as error:  # export raises many types; all mean "cannot trace"
        raise TraceError.from_export_error(model, error) from error
    notes += [checkpoints.note()] if checkpoints.calls else []
    _refuse_data_dependent_sizes(exported.graph_module, model)
    exported, written_back = _functionalize_aliased_writes(exported)

    gm = exported.graph_module
    _write_back_mutations(gm, written_back)
    _differentiable_copies(gm)
    _rename_unstable(gm)
    _inline_wrappers(gm)
    _drop_assertions(gm)
    notes += _dense_embedding_grads(gm)
    inputs, constants = _graph_inputs(exported, gm)
    _attention_masks(gm, constants, inputs, (example_inputs, example_kwargs or {}))
    if precision is not None and precision.casts:
        _cast_parameters(gm, inputs, precision)
    renamed = canonical_names(gm)
    inputs = [GraphInput(renamed.get(i.name, i.name), i.kind, i.fqn) for i in inputs]
    constants = {renamed.get(name, name): value for name, value in constants.items()}
    _mark_requires_grad(gm)
    call_spec = exported.call_spec
    return TracedModel(
        gm=gm,
        inputs=tuple(inputs),
        in_spec=call_spec.in_spec,
        out_spec=call_spec.out_spec,
        ties=_ties(model),
        constants=constants,
        graph_hash=graph_hash(gm),
        notes=tuple(notes),
        trace_s=time.perf_counter() - start,
        checkpointing=checkpoints.policy,
        checkpointed=checkpoints.layers,
        **_read_fields(model, read),
    )


def _attention_masks(gm: torch.fx.GraphModule, constants: dict, inputs: list[GraphInput], example: tuple) -> None:
    """A traced causal mask back to SDPA's ``is_causal``, and a mask from the batch marked where
    the ``example`` batch makes it causal (``trace.attention``). The example's leaves are the
    user inputs in order; meta and fake tensors hold no values to check."""
    causal_attention(gm, constants)
    leaves = pytree.tree_leaves(example)
    users = [i.name for i in inputs if i.kind == "user"]
    if len(leaves) != len(users):
        return
    real = {
        name: value
        for name, value in zip(users, leaves)
        if isinstance(value, torch.Tensor) and not value.is_meta and not is_fake(value)
    }
    causal_for_the_example(gm, constants, real)


def _refuse_data_dependent_sizes(gm: torch.fx.GraphModule, model: torch.nn.Module) -> None:
    """A ``TraceError`` where an op of the graph makes a tensor whose size the data decides (an
    unbacked size: boolean-mask indexing, ``nonzero``, a split by counts computed in forward):
    the planner shards, prices and checks fixed shapes, and such an op would reach it as a crash
    in a rule. Export traces these; eager runs them. (A mixture of experts that routes that way
    inside a stacked-experts module is one op here, ``trace.moe``, and is not refused.)"""
    for node in gm.graph.nodes:
        symbols = free_unbacked_symbols(node.meta.get("val"))
        if not symbols:
            continue
        stack = node.meta.get("nn_module_stack") or {}
        path, kind = next(reversed(stack.values()), ("", None))
        where = f" in {path or 'the model'} ({getattr(kind, '__name__', kind) or type(model).__name__})"
        raise TraceError(
            f"could not plan {type(model).__name__}: {node.target}{where} gives a size that depends on the data "
            f"({', '.join(sorted(map(str, symbols)))}), not on the input shapes; autopar plans, shards and prices "
            "fixed shapes. Compute it with sizes that shapes decide: a mask with torch.where or "
            "masked_fill instead of boolean indexing or nonzero, a fixed capacity padded per expert instead of "
            "a split by counts (a mixture of experts whose experts are one stacked module is traced as one op "
            "and planned: docs/long-sequences-and-experts.md), or keep that module out of the compiled model"
        )


def _graph_inputs(exported, gm: torch.fx.GraphModule) -> tuple[list[GraphInput], dict[str, torch.Tensor]]:
    """Each placeholder of ``gm`` (``exported``'s graph) as a ``GraphInput`` of its kind, and the
    values of those that are constants. A graph that writes a parameter is refused here."""
    inputs: list[GraphInput] = []
    constants: dict[str, torch.Tensor] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for spec, placeholder in zip(exported.graph_signature.input_specs, placeholders, strict=True):
        kind = _KINDS.get(spec.kind)
        if kind is None:
            raise TraceError(
                f"the exported graph has an input of kind {spec.kind} ({spec.arg.name}), which autopar does not handle yet"
            )
        name = placeholder.name  # renamed by _rename_unstable where export's name was unsafe
        inputs.append(GraphInput(name, kind, spec.target))
        if kind == "constant":
            constants[name] = exported.constants[spec.target]
    # with the no_grad regions inlined, a write into a parameter under one shows
    _refuse_parameter_writes(gm, {i.name: i.fqn for i in inputs if i.kind == "param"})
    return inputs, constants


@contextlib.contextmanager
def _no_caches(model: torch.nn.Module):
    """Trace with every ``config.use_cache`` off (Hugging Face models, whose configs default to
    True: their forward then returns a key/value cache, an object export cannot return). A
    training step reads no cache, so the graph returns none: the outputs' cache field is absent
    where the eager model's holds a cache. Yields the notes that say so, for the plan."""
    configs = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", None) is True:
            configs[id(config)] = config
    notes = []
    if configs:
        notes.append(
            f"{type(model).__name__}'s config has use_cache=True: traced with use_cache=False, so the "
            "compiled module returns no key/value cache (past_key_values); a training step reads none"
        )
    for config in configs.values():
        config.use_cache = False
    try:
        yield notes
    finally:
        for config in configs.values():
            config.use_cache = True


@contextlib.contextmanager
def _sync_batch_norms_as_batch_norms(model: torch.nn.Module, notes: list[str]):
    """Trace each ``nn.SyncBatchNorm`` as the ``BatchNorm`` it is on one process. Under a process
    group its forward would all-gather statistics over the world while tracing (and refuse a CPU
    input); a plan's batch norm already takes its statistics over the whole batch, however the
    batch is split, which is what ``SyncBatchNorm`` computes over DDP's ranks. Adds a note."""
    synced = [m for m in model.modules() if isinstance(m, torch.nn.SyncBatchNorm)]
    if synced:
        notes.append(
            f"{len(synced)} SyncBatchNorm layer{'s' if len(synced) > 1 else ''} traced as BatchNorm: the plan takes "
            "batch statistics over the whole batch, as SyncBatchNorm does over DDP's ranks"
        )
    own = [module.__dict__.get("forward") for module in synced]  # an instance's own forward, kept
    for module in synced:
        module.forward = types.MethodType(torch.nn.modules.batchnorm._BatchNorm.forward, module)
    try:
        yield
    finally:
        for module, forward in zip(synced, own):
            if forward is None:
                del module.forward
            else:
                module.forward = forward


def _read_fields(model: torch.nn.Module, found: Reads) -> dict[str, Any]:
    """``TracedModel.reads`` (each attribute's value after the trace, in a stable order),
    ``carried`` and ``sets``, of what ``model_reads`` found."""
    values = []
    for fqn, name in sorted(found.read):
        attributes = model.get_submodule(fqn).__dict__ if fqn else model.__dict__
        if name in attributes and isinstance(attributes[name], GUARDED):
            values.append((fqn, name, attributes[name]))
    return {"reads": tuple(values), "carried": tuple(sorted(found.carried)), "sets": tuple(sorted(found.sets))}


def _refuse_cache_inputs(example_kwargs: dict[str, Any] | None) -> None:
    """A call that asks for a cache (``use_cache=True``) or passes one cannot be a training graph."""
    kwargs = example_kwargs or {}
    if kwargs.get("use_cache") is True:
        raise TraceError(
            "the example inputs pass use_cache=True, which makes the model return a key/value cache: "
            "a training graph returns none. Drop use_cache from the inputs (autopar traces with "
            "use_cache=False) or pass use_cache=False"
        )
    if kwargs.get("past_key_values") is not None:
        raise TraceError(
            "the example inputs pass past_key_values (a key/value cache): autopar compiles the training "
            "step, which reads no cache. Drop past_key_values from the inputs"
        )


def _is_view(node: torch.fx.Node) -> bool:
    """Whether ``node``'s output shares storage with its first input (a view, a chunk of a
    split, an alias), by the op's schema."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return _is_view(node.args[0])
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or not target._schema.returns:
        return False
    alias = target._schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def aliased_writes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """In-place writes that reach a tensor through an alias: a write into a view (``x[:, 1:] =
    y``, ``x.chunk(2)[0].mul_(2)``), or into a tensor that has views. Sharding plans each node's
    value on its own, so such a write would land in one value and not the other; ``trace``
    functionalizes graphs that have any."""
    found = []
    for node in gm.graph.nodes:
        for target in written(node):
            if _is_view(target) or any(_is_view(user) for user in target.users if user is not node):
                found.append(node)
                break
    return found


def _parameter_names(exported) -> dict[str, str]:
    return {spec.arg.name: spec.target for spec in exported.graph_signature.input_specs if spec.kind == InputKind.PARAMETER}


def _refuse_parameter_writes(gm: torch.fx.GraphModule, params: dict[str, str]) -> None:
    """Refuse a forward that writes a parameter in place (weight clipping or renormalization under
    ``torch.no_grad()``, ``nn.Embedding(max_norm=...)``). Export traces it as a write into a
    detached alias of the parameter, and the forward's later uses read that alias: the graph gives
    them no gradient where eager does (a linear layer clipped so trained 4.2 off eager, without a
    word); and under a plan each rank would write its own shard or copy, out of the order its
    gathers read them. ``params``: each parameter placeholder's name → its FQN."""
    for node in gm.graph.nodes:
        for target in written(node):
            root = target
            while _is_view(root):
                root = root.args[0]
            if root.op == "placeholder" and root.name in params:
                fqn = params[root.name]
                raise TraceError(
                    f"the model's forward writes parameter {fqn!r} in place ({node.target.__name__}: weight "
                    "clipping or renormalization under torch.no_grad(), a momentum teacher's update (MoCo, BYOL), "
                    "or nn.Embedding(max_norm=...), which renormalizes the rows it looks up). A compiled graph "
                    "cannot carry that write: the forward's "
                    "later uses of the parameter would train no gradient, and each rank would write its own shard. "
                    "Write it outside the forward, after optimizer.step(), under torch.no_grad(), on the compiled "
                    f"module's parameter (pm.module.{fqn}); for nn.Embedding, drop max_norm and renormalize there"
                )


def _functionalize_aliased_writes(exported):
    """Export's own functionalization (``run_decompositions`` with an empty table: composite
    ops stay whole, writes become ``slice_scatter``, ``select_scatter``, ``index_put``, ...),
    for graphs with a write through an alias. Graphs without one are kept exactly as traced.
    Returns the program and its mutated inputs: (graph output index, placeholder name)."""
    _refuse_parameter_writes(exported.graph_module, _parameter_names(exported))  # export's own may be one
    if not aliased_writes(exported.graph_module):
        return exported, []
    from torch.export.graph_signature import OutputKind

    try:
        exported = exported.run_decompositions({})
    except Exception as error:  # noqa: BLE001 - any failure here means "cannot functionalize"
        raise TraceError(
            "the model writes in place into a view or slice (for example x[:, 1:] = y, or "
            f"copy_/fill_/mul_ on a chunk), and functionalizing those writes failed: {type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}. Write the result out of place "
            "(torch.cat, torch.where, Tensor.index_put) instead."
        ) from error
    signature = exported.graph_signature
    names = {spec.target: spec.arg.name for spec in signature.input_specs if spec.target is not None}
    names.update({spec.arg.name: spec.arg.name for spec in signature.input_specs})
    written_back = []
    for index, spec in enumerate(signature.output_specs):
        if spec.kind == OutputKind.BUFFER_MUTATION:
            written_back.append((index, names[spec.target]))
        elif spec.kind == OutputKind.USER_INPUT_MUTATION:
            written_back.append((index, spec.target))
        elif spec.kind not in (OutputKind.USER_OUTPUT, OutputKind.LOSS_OUTPUT):
            raise TraceError(f"functionalized graph has an output of kind {spec.kind}, which autopar does not handle")
    return exported, written_back


def _write_back_mutations(gm: torch.fx.GraphModule, written_back: list[tuple[int, str]]) -> None:
    """Functionalization returns the new value of each mutated buffer or input as an extra graph
    output; write it back in place (``copy_`` into the placeholder, as eager does) and drop the
    output, so the graph returns what the model returns."""
    if not written_back:
        return
    graph = gm.graph
    output = graph.output_node()
    values = list(output.args[0])
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    with graph.inserting_before(output):
        for index, name in written_back:
            target = placeholders[name]
            node = graph.call_function(torch.ops.aten.copy_.default, (target, values[index]))
            node.meta["val"] = target.meta["val"]
    drop = {index for index, _ in written_back}
    output.args = (tuple(v for i, v in enumerate(values) if i not in drop),)
    gm.recompile()


def _differentiable_copies(gm: torch.fx.GraphModule) -> None:
    """Functionalization writes ``dst.copy_(src)`` as ``aten.copy(dst, src)``, which autograd
    cannot differentiate (compiled graphs run under eager autograd). Its value is ``src`` cast
    to ``dst``'s dtype and broadcast to its shape: the node becomes exactly that."""
    graph = gm.graph
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.copy.default:
            continue
        dst, src = node.args[0], node.args[1]
        want, have = dst.meta["val"], src.meta["val"]
        value = src
        with graph.inserting_before(node):
            if have.dtype != want.dtype:
                value = graph.call_function(torch.ops.aten._to_copy.default, (value,), {"dtype": want.dtype})
                value.meta["val"] = have.to(want.dtype)
            if tuple(have.shape) != tuple(want.shape):
                value = graph.call_function(torch.ops.aten.expand.default, (value, list(want.shape)))
                value.meta["val"] = value.args[0].meta["val"].expand(want.shape)
        node.replace_all_uses_with(value)
        graph.erase_node(node)
        changed = True
    if changed:
        gm.recompile()


def _rename_unstable(gm: torch.fx.GraphModule) -> None:
    """Give a new name to every node whose name fx would change when it copies the graph (a
    Python builtin or keyword: an argument called ``input``, ``type`` or ``id``). Plans are
    keyed by node name, and ``compile`` rewrites a deep copy of the traced graph."""
    from torch.fx.graph import _illegal_names

    renamed = False
    for node in gm.graph.nodes:
        if node.name in _illegal_names:
            node._rename(f"{node.name}_1")
            renamed = True
    if renamed:
        gm.recompile()


_NAME = re.compile(r"^([a-zA-Z_][0-9a-zA-Z_]*?)(?:_(\d+))?$")  # fx's own: base, then an optional _N


def name_base(name: str) -> str:
    """The part of an fx node name before its counter: ``linear`` of ``linear_3``."""
    match = _NAME.match(name)
    return match.group(1) if match else name


def canonical_names(gm: torch.fx.GraphModule) -> dict[str, str]:
    """Number every node's name afresh in graph order, as fx would have named the nodes had they
    been created in that order: the k-th node of base ``mul`` is ``mul_k`` (``mul`` for the
    first; builtins and keywords skip to ``_1``). Export's counters also count nodes it
    deleted, and nodes inlined or inserted later (``_inline_wrappers``, ``_cast_parameters``)
    are numbered after every earlier one, so its names depend on the model's depth beyond the
    node's own place; canonical names depend on the graph alone, which lets
    ``trace.repeat`` build a deep model's graph from a shallow one's. Returns the old name →
    new name of the nodes renamed."""
    namespace = torch.fx.graph._Namespace()
    renamed: dict[str, str] = {}
    for node in gm.graph.nodes:
        name = namespace.create_name(name_base(node.name), node)
        if name != node.name:
            renamed[node.name] = name
            node.name = name
    if renamed:
        gm.graph._graph_namespace = namespace
        gm.recompile()
    return renamed


def _fake_params(model: torch.nn.Module, inputs: Any, precision: MixedPrecision | None) -> contextlib.AbstractContextManager:
    """A model built on the meta device, called with real inputs, is traced as if it were built
    on the inputs' device (same graph and hash); with meta inputs it is traced as it is. Under a
    precision policy with a ``param_dtype``, floating parameters are swapped for that dtype."""
    param_dtype = to_dtype(precision.param_dtype) if precision is not None else None
    if not has_meta_tensors(model) and param_dtype is None:
        return contextlib.nullcontext()
    tensors = [t for t in torch.utils._pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    real = [t.device for t in tensors if not t.is_meta]
    if tensors and not real:
        return fake_tensors(model, "meta", param_dtype) if param_dtype is not None else contextlib.nullcontext()
    return fake_tensors(model, real[0] if real else "cpu", param_dtype)


def is_param_cast(node: torch.fx.Node) -> bool:
    """A precision policy's cast of a parameter to ``param_dtype`` (``_cast_parameters`` marks it
    ``cast_of``; ``passes.precision`` may move it past the parameter's gather)."""
    return (
        node.op == "call_function"
        and node.target is torch.ops.aten._to_copy.default
        and "cast_of" in node.meta.get("autopar", {})
    )


def _cast_parameters(gm: torch.fx.GraphModule, inputs: list[GraphInput], precision: MixedPrecision) -> None:
    """Parameters hold the master dtype and are cast where used, as autocast and FSDP2 do: each
    floating parameter placeholder takes ``master_dtype``, and one ``_to_copy`` to its traced
    dtype, inserted before its first use, feeds every use. The cast carries
    ``meta["autopar"]["reduce_dtype"]``: the dtype its gradient is reduced in across ranks, which
    the cost model prices."""
    master = to_dtype(precision.master_dtype)
    reduce_dtype = to_dtype(precision.reduce_dtype or precision.param_dtype)
    kinds = {i.name: i for i in inputs}
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in [n for n in gm.graph.nodes if n.op == "placeholder"]:
        val, info = node.meta.get("val"), kinds.get(node.name)
        if info is None or info.kind != "param" or not isinstance(val, torch.Tensor) or not val.is_floating_point():
            continue
        if val.dtype == master:
            continue
        if node.users:  # (a tied weight's other names may have none: export routes uses to one)
            first_use = min(node.users, key=position.__getitem__)
            with gm.graph.inserting_before(first_use):
                cast = gm.graph.call_function(torch.ops.aten._to_copy.default, (node,), {"dtype": val.dtype})
            node.replace_all_uses_with(cast, delete_user_cb=lambda user, cast=cast: user is not cast)
            cast.meta["val"] = val
            cast.meta["autopar"] = {"reduce_dtype": reduce_dtype, "cast_of": info.fqn}
            if first_use.meta.get("nn_module_stack"):  # the cast belongs to the layer that uses it
                cast.meta["nn_module_stack"] = first_use.meta["nn_module_stack"]
        with getattr(val, "fake_mode", None) or contextlib.nullcontext():
            node.meta["val"] = torch.empty(
                val.shape, dtype=master, device=val.device, requires_grad=bool(getattr(val, "requires_grad", False))
            )
    gm.recompile()


def _lazy_recompile() -> contextlib.AbstractContextManager:
    """Export's passes regenerate the whole graph's Python code some thirty times on a Hugging
    Face decoder (each split and inline of a no-grad or autocast region); lazily, it is generated
    when first needed. The same graph; a fifth less export time on an 80-layer LLaMA."""
    try:
        from torch.fx._lazy_graph_module import _use_lazy_graph_module
    except ImportError:  # older torch: recompile eagerly
        return contextlib.nullcontext()
    return _use_lazy_graph_module(True)


@contextlib.contextmanager
def _no_stack_traces():
    """Nothing here reads node stack traces, and recording one per node is an eighth of the
    export time on deep models. Older torch (before the switch existed) records them anyway."""
    config = getattr(torch.fx, "config", None)
    if config is None or not hasattr(config, "do_not_emit_stack_traces"):
        yield
        return
    saved = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = saved


def requires_grad(node: torch.fx.Node) -> bool:
    """Whether autograd will carry a gradient for ``node``'s output (set by ``trace``)."""
    return bool(node.meta.get("autopar", {}).get("requires_grad", False))


def _mark_requires_grad(gm: torch.fx.GraphModule) -> None:
    """Propagate requires_grad from the placeholders: export's FakeTensors carry it only on
    parameters and inputs, not on the values computed from them."""
    for node in gm.graph.nodes:
        meta = node.meta.setdefault("autopar", {})
        val = node.meta.get("val")
        if node.op == "placeholder":
            meta["requires_grad"] = bool(getattr(val, "requires_grad", False))
            continue
        if node.target is torch.ops.aten.detach.default:
            meta["requires_grad"] = False
            continue
        inputs = [n for n in node.all_input_nodes if requires_grad(n)]
        values = val if isinstance(val, (list, tuple)) else [val]
        floating = any(isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()) for v in values)
        meta["requires_grad"] = bool(inputs) and floating and node.op != "output"


def _wrapped_body(node: torch.fx.Node) -> tuple[torch.fx.GraphModule, list[Any], bool] | None:
    """For a grad-mode or autocast wrapper node: its body, operands and whether its outputs are
    cut from autograd. None for any other node."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
        return None
    name = node.target.name()
    if name not in ("wrap_with_set_grad_enabled", "wrap_with_autocast"):
        return None
    position = next((i for i, a in enumerate(node.args) if isinstance(a, torch.fx.Node) and a.op == "get_attr"), None)
    if position is None:
        return None
    body = getattr(node.graph.owning_module, node.args[position].target)
    operands = list(node.args[position + 1 :])
    if name == "wrap_with_autocast":
        if node.args[2]:  # (device_type, dtype, enabled, cache_enabled, body, *operands)
            raise TraceError(
                f"the model enables autocast inside forward ({node.format_node()}), which autopar "
                "cannot shard: run it without autocast inside (cast the model, e.g. model.bfloat16())"
            )
        return body, operands, False
    return body, operands, not node.args[0]


def _inline_wrappers(gm: torch.fx.GraphModule) -> None:
    """Inline the bodies of ``torch.no_grad()`` / ``set_grad_enabled`` and disabled-autocast
    regions, which export keeps as higher-order ops over submodules (Hugging Face rotary
    embeddings run under both). Rules see only ATen ops, and a flat graph shards like any other.
    A no-grad region's outputs, and its inputs that may need grad, go through ``aten.detach``, so
    that autograd still stops there and its ops run on tensors that need no grad, as under
    ``no_grad`` (an op with ``out=``, such as ``spectral_norm``'s power iteration, refuses inputs
    that need grad).
    Disabled autocast is the identity for a model that runs without autocast, as training under
    autopar does."""
    graph = gm.graph
    for node in list(graph.nodes):
        found = _wrapped_body(node)
        if found is None:
            continue
        body, operands, no_grad = found
        env: dict[torch.fx.Node, Any] = {}
        outputs: Any = ()
        placeholders = iter(operands)
        with graph.inserting_before(node):
            for inner in body.graph.nodes:
                if inner.op == "placeholder":  # a no-grad region reads inputs that need grad cut from autograd
                    operand = next(placeholders)
                    env[inner] = _detached(graph, operand) if no_grad and _may_need_grad(operand) else operand
                elif inner.op == "output":
                    outputs = torch.fx.node.map_arg(inner.args[0], env.__getitem__)
                elif inner.op == "get_attr":
                    target = _free_attr_name(gm, inner.target)
                    setattr(gm, target, getattr(body, inner.target))
                    env[inner] = graph.get_attr(target)
                    env[inner].meta = dict(inner.meta)
                else:
                    env[inner] = graph.node_copy(inner, env.__getitem__)
            if no_grad:
                outputs = [_detached(graph, out) for out in outputs]
        for user in list(node.users):
            assert user.target is operator.getitem, user.format_node()
            user.replace_all_uses_with(outputs[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(node)
        _inline_wrappers(gm)  # a body may hold wrappers of its own
        return
    for node in list(graph.nodes):
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
    gm.delete_all_unused_submodules()
    gm.recompile()


def _may_need_grad(value: Any) -> bool:
    """Whether a placeholder that needs grad (a parameter; export's FakeTensors say so on
    placeholders only) reaches ``value`` through ops other than ``detach``."""
    todo, seen = [value] if isinstance(value, torch.fx.Node) else [], set()
    while todo:
        node = todo.pop()
        if node in seen or node.target is torch.ops.aten.detach.default:
            continue
        seen.add(node)
        if node.op == "placeholder" and getattr(node.meta.get("val"), "requires_grad", False):
            return True
        todo.extend(node.all_input_nodes)
    return False


def _detached(graph: torch.fx.Graph, value: Any) -> Any:
    if not isinstance(value, torch.fx.Node) or not isinstance(value.meta.get("val"), torch.Tensor):
        return value
    detached = graph.call_function(torch.ops.aten.detach.default, (value,))
    detached.meta["val"] = value.meta["val"].detach()
    return detached


def _free_attr_name(gm: torch.fx.GraphModule, name: str) -> str:
    candidate, index = name, 0
    while hasattr(gm, candidate):
        index += 1
        candidate = f"{name}_inlined_{index}"
    return candidate


def _dense_embedding_grads(gm: torch.fx.GraphModule) -> list[str]:
    """``nn.Embedding(sparse=True)`` makes its weight's gradient a sparse tensor, which no
    collective, bucket or sharded gradient of a plan holds: such embeddings give dense gradients
    (the same numbers; torch's SGD and Adagrad step them alike, ``SparseAdam`` refuses them by
    name). Returns the note that says so, if any."""
    sparse = [
        n
        for n in gm.graph.nodes
        if n.target is torch.ops.aten.embedding.default and (n.kwargs.get("sparse") or (len(n.args) > 4 and n.args[4]))
    ]
    for node in sparse:
        if len(node.args) > 4:
            node.args = (*node.args[:4], False)
        else:
            node.kwargs = {**node.kwargs, "sparse": False}
    if not sparse:
        return []
    gm.recompile()
    return [
        f"{len(sparse)} embedding{'s' if len(sparse) > 1 else ''} with sparse=True give{'' if len(sparse) > 1 else 's'} "
        "dense gradients: a plan's collectives move dense ones (the same numbers; SparseAdam takes none)"
    ]


def _drop_assertions(gm: torch.fx.GraphModule) -> None:
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _ASSERTION_OPS and not node.users:
            gm.graph.erase_node(node)
    gm.recompile()


def _ties(model: torch.nn.Module) -> dict[str, str]:
    """Map every parameter FQN to the first FQN under which the same tensor appears."""
    canonical: dict[int, str] = {}
    ties: dict[str, str] = {}
    for fqn, param in model.named_parameters(remove_duplicate=False):
        first = canonical.setdefault(id(param), fqn)
        ties[fqn] = first
    return ties


def graph_hash(gm: torch.fx.GraphModule) -> str:
    """A structural hash: ops, argument structure, shapes and dtypes, in graph order. Devices
    are left out, so that a plan made on the meta device matches the model on its real one."""
    digest = hashlib.sha256()
    # A deep model's layers are copies (``trace.repeat``): its nodes share targets and values,
    # so each one's text is made once (keyed by identity: the graph holds them while this runs).
    targets: dict[int, str] = {}
    vals: dict[int, str] = {}
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        target = targets.get(id(node.target))
        if target is None:
            target = targets[id(node.target)] = _target_name(node.target)
        described = vals.get(id(val))
        if described is None:
            described = vals[id(val)] = repr(_describe(val))
        digest.update(f"{node.op}|{node.name}|{target}|{_describe(node.args)!r}{_describe(node.kwargs)!r}{described}".encode())
    return digest.hexdigest()[:16]


def _target_name(target: Any) -> str:
    # str() of a plain function includes its address, which differs between processes.
    if isinstance(target, torch._ops.OpOverload) or not callable(target):
        return str(target)
    return f"{target.__module__}.{target.__qualname__}"


def _describe(value: Any) -> Any:
    if isinstance(value, torch.fx.Node):
        return f"%{value.name}"
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), str(value.dtype))
    if isinstance(value, (list, tuple)):
        return tuple(_describe(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _describe(v)) for k, v in sorted(value.items()))
    if isinstance(value, torch.device):
        # A plan made on the meta device must apply to the model on its real device.
        return "device"
    if isinstance(value, (torch.dtype, torch.memory_format, torch.layout)):
        return str(value)
    return value
