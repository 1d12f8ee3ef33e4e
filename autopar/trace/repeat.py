"""Trace a deep model at the cost of a shallow one: export a copy with its repeated layers cut to
two, and build the full graph from it.

``torch.export`` costs a few milliseconds per op, so an 80-layer LLaMA takes half a minute to
trace, and its layers are all the same code on the same shapes. ``trace_repeated``:

1. finds the model's *layer list*: a top-level ``nn.ModuleList`` (or ``nn.Sequential``) of at
   least ``MIN_LAYERS`` structurally identical modules (same classes, parameter and buffer
   names, shapes and dtypes, the same attributes up to the layer's own index, no tied weights);
2. exports two copies of the model whose list holds only its first ``_SMALL`` and
   ``_SMALL + 1`` layers (the same module objects: nothing is copied but the path to the list);
3. builds the ``_SMALL + 1``-layer graph from the ``_SMALL``-layer one (``synthesize``) and
   checks that it *is* the exported one: same graph hash (ops, names, arguments, shapes,
   dtypes), same inputs and FQNs, same module paths, same metadata;
4. if so, builds the full-depth graph the same way; otherwise (or when anything above fails)
   it traces the whole model, and says why in a debug log.

``synthesize`` copies the last layer of the small graph once per missing layer: its nodes, with
arguments that read the same layer mapped to the new one, those that read the layer before to
the new one's predecessor, and everything outside the layers kept; the nodes after the layers
read the last layer. Parameter placeholders, their FQNs and the module paths in
``nn_module_stack`` take the new layer's index. Node names are canonical
(``export.canonical_names``: numbered in graph order), so the copy's names are those a full
export gives. ``autopar.compile`` traces the real model and checks the plan's graph hash, so a
plan made on a synthesized graph that differed from the real one would be refused, not run.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import re
import time
from typing import Any

import torch
import torch.fx

from autopar.ir.options import MixedPrecision
from autopar.trace.export import GraphInput, TracedModel, graph_hash, name_base, trace
from autopar.trace.hooks import check_hooks

log = logging.getLogger("autopar")

# Lists shorter than this are traced as they are: two small exports cost as much as three layers.
MIN_LAYERS = 5
# Depth of the copy the graph is built from; the copy one layer deeper checks the construction.
_SMALL = 2


class _Mismatch(Exception):
    """The small graph does not extend layer by layer (the reason is the message)."""


def trace_repeated(
    model: torch.nn.Module,
    example_inputs: tuple[Any, ...] = (),
    example_kwargs: dict[str, Any] | None = None,
    precision: MixedPrecision | None = None,
) -> TracedModel:
    """``trace.trace``'s graph of ``model``, built from a two-layer export where the model
    repeats one layer (see the module docstring), else traced whole; ``trace_s`` holds all the
    exports it took."""
    start = time.perf_counter()
    traced = _built_or_traced(model, example_inputs, example_kwargs, precision)
    return dataclasses.replace(traced, trace_s=time.perf_counter() - start)


def _built_or_traced(model, example_inputs, example_kwargs, precision) -> TracedModel:
    """``trace_repeated``'s graph, untimed."""
    check_hooks(model)
    found = layer_list(model)
    if found is None:
        return trace(model, example_inputs, example_kwargs, precision)
    path, depth = found
    try:
        small = trace(_cut(model, path, _SMALL), example_inputs, example_kwargs, precision)
        check = trace(_cut(model, path, _SMALL + 1), example_inputs, example_kwargs, precision)
        built = synthesize(small, path, _SMALL + 1, check.ties)
        reason = difference(built, check)
        if reason is None:
            full = synthesize(small, path, depth, _ties(model))
            log.info("autopar: built the %d-layer graph of %s from a %d-layer export", depth, path, _SMALL)
            return full
    except Exception as error:  # noqa: BLE001 - whatever fails here, the whole export is the answer
        reason = f"{type(error).__name__}: {error}"
    log.debug("autopar: tracing all %d layers of %s: the layer-by-layer construction does not apply (%s)", depth, path, reason)
    return trace(model, example_inputs, example_kwargs, precision)


# -- the layer list ------------------------------------------------------------------------------


def layer_list(model: torch.nn.Module) -> tuple[str, int] | None:
    """(path, length) of the model's list of identical layers, or None. Only lists outside any
    other numbered module are considered (not the experts inside a layer), and of those the
    one holding the most parameters."""
    shared = _shared_tensors(model)
    best: tuple[int, str, int] | None = None
    for path, module in model.named_modules(remove_duplicate=False):
        if not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) or not path:
            continue
        if any(part.isdigit() for part in path.split(".")) or len(module) < MIN_LAYERS:
            continue
        layers = list(module)
        if [str(i) for i in range(len(layers))] != list(module._modules):
            continue
        if not _identical(layers) or len({id(layer) for layer in layers}) != len(layers):
            continue
        if any(id(t) in shared for layer in layers for t in _tensors(layer)):
            continue  # a layer's weight is tied to another module's
        size = sum(p.numel() for layer in layers for p in layer.parameters())
        if best is None or size > best[0]:
            best = (size, path, len(layers))
    return None if best is None else (best[1], best[2])


def _tensors(module: torch.nn.Module):
    for _, tensor in module.named_parameters(remove_duplicate=False):
        yield tensor
    for _, tensor in module.named_buffers(remove_duplicate=False):
        yield tensor


def _shared_tensors(model: torch.nn.Module) -> set[int]:
    seen: dict[int, int] = {}
    for tensor in _tensors(model):
        seen[id(tensor)] = seen.get(id(tensor), 0) + 1
    return {key for key, count in seen.items() if count > 1}


def _identical(layers: list[torch.nn.Module]) -> bool:
    """Whether the layers' fingerprints agree, where an integer attribute that is each layer's
    own index (Hugging Face's ``layer_idx``) counts as agreeing."""
    prints = [_fingerprint(layer) for layer in layers]
    if any(len(p) != len(prints[0]) for p in prints):
        return False
    index = list(range(len(layers)))
    for column in zip(*prints):
        if all(item == column[0] for item in column):
            continue
        if (
            all(item[:-1] == column[0][:-1] and type(item[-1]) is int for item in column)
            and [item[-1] for item in column] == index
        ):
            continue
        return False
    return True


def _fingerprint(layer: torch.nn.Module) -> tuple:
    """What must agree between two layers for one to stand for the other: every submodule's
    class, parameters and buffers (name, shape, dtype, requires_grad), and plain attributes;
    nn.Module's private tables (hooks) by size. Any other object must be the same object in
    every layer."""
    items = []
    for name, module in layer.named_modules():
        items.append(("module", name, type(module)))
        for key, param in module._parameters.items():
            items.append(
                (
                    "param",
                    name,
                    key,
                    None if param is None else (tuple(param.shape), param.dtype, param.requires_grad, type(param)),
                )
            )
        for key, buffer in module._buffers.items():
            items.append(
                (
                    "buffer",
                    name,
                    key,
                    None if buffer is None else (tuple(buffer.shape), buffer.dtype),
                    key in module._non_persistent_buffers_set,
                )
            )
        for key, value in sorted(vars(module).items()):
            if key in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"):
                continue
            if key.startswith("_") and isinstance(value, (dict, set)):  # nn.Module's hooks and such
                items.append(("private", name, key, len(value)))
            else:
                items.append(("attr", name, key, _value(value)))
    return tuple(items)


def _value(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return value
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_value(v) for v in value))
    return ("object", id(value))


def _cut(model: torch.nn.Module, path: str, depth: int) -> torch.nn.Module:
    """A copy of ``model`` whose list at ``path`` holds its first ``depth`` layers: the modules
    on the path are shallow copies, everything else (the layers included) is shared."""
    parts = path.split(".")
    root = copy.copy(model)
    root._modules = dict(model._modules)
    parent = root
    for part in parts[:-1]:
        child = copy.copy(parent._modules[part])
        child._modules = dict(child._modules)
        parent._modules[part] = child
        parent = child
    layers = parent._modules[parts[-1]]
    short = copy.copy(layers)
    short._modules = {str(i): layers._modules[str(i)] for i in range(depth)}
    parent._modules[parts[-1]] = short
    return root


def _ties(model: torch.nn.Module) -> dict[str, str]:
    canonical: dict[int, str] = {}
    return {fqn: canonical.setdefault(id(p), fqn) for fqn, p in model.named_parameters(remove_duplicate=False)}


# -- building the deep graph ---------------------------------------------------------------------


class _Relayer:
    """Puts the path of layer ``index`` inside a module path (sep ".") or a placeholder name
    (sep "_") to another layer's: ``relayer(layer, text)``. Each text is cut once, at the index
    of every occurrence of the path, so its copies in a deep model are joins of the same cuts."""

    def __init__(self, path: str, index: int, sep: str):
        self.token = re.compile(r"(?:^|(?<=[._]))(" + re.escape(path.replace(".", sep) + sep) + ")" + str(index) + r"(?=$|[._])")
        self.cuts: dict[str, list[str]] = {}

    def __call__(self, layer: int, text: str) -> str:
        parts = self.cuts.get(text)
        if parts is None:
            parts, start = [], 0
            for match in self.token.finditer(text):
                parts.append(text[start : match.end(1)])
                start = match.end()
            parts.append(text[start:])
            self.cuts[text] = parts
        return str(layer).join(parts)


def _layer_of(node: torch.fx.Node, fqns: dict[str, str | None], path: str) -> int | None:
    prefix = path + "."
    where = fqns.get(node.name) if node.op == "placeholder" else None
    if where is None and node.op != "placeholder":
        stack = node.meta.get("nn_module_stack")
        where = list(stack.values())[-1][0] if stack else None
    if not where or not where.startswith(prefix):
        return None
    return int(where[len(prefix) :].split(".", 1)[0])


def _segments(nodes: list[torch.fx.Node], layers: list[int | None], depth: int) -> list[tuple[int, int]]:
    """[start, end) of each run of consecutive layer nodes; each must hold layers 0..depth-1 in
    order, each one contiguous block."""
    runs, start = [], None
    for i, layer in enumerate(layers + [None]):
        if layer is not None and start is None:
            start = i
        elif layer is None and start is not None:
            runs.append((start, i))
            start = None
    for start, end in runs:
        order = [layers[start]]
        for layer in layers[start + 1 : end]:
            if layer != order[-1]:
                order.append(layer)
        if order != list(range(depth)):
            raise _Mismatch(f"the nodes from {nodes[start].name} run through layers {order}, not 0..{depth - 1} in order")
    return runs


def _node_layers(nodes: list[torch.fx.Node], fqns: dict[str, str | None], path: str) -> list[int | None]:
    """The layer of ``path`` each node belongs to (None: outside the layers). A node of no module
    (an inlined detach, a cast) between two nodes of one layer is in it."""
    layers = [_layer_of(node, fqns, path) for node in nodes]
    for i, layer in enumerate(layers):
        if layer is None and nodes[i].op != "output" and 0 < i < len(nodes) - 1:
            before = next((x for x in reversed(layers[:i]) if x is not None), None)
            after = next((x for x in layers[i + 1 :] if x is not None), None)
            if before is not None and before == after and nodes[i].op != "placeholder":
                layers[i] = before
    return layers


def _blocks(
    nodes: list[torch.fx.Node], layers: list[int | None], runs: list[tuple[int, int]], kinds: dict, path: str
) -> tuple[dict[torch.fx.Node, tuple[int, int, int]], list[dict[int, list[torch.fx.Node]]]]:
    """(node → (run, layer, position in its layer), each run's nodes by layer); ``_Mismatch``
    where a layer reads a module attribute, has a lifted constant, or the layers differ in size."""
    slot: dict[torch.fx.Node, tuple[int, int, int]] = {}
    blocks: list[dict[int, list[torch.fx.Node]]] = []
    for seg, (start, end) in enumerate(runs):
        by_layer: dict[int, list[torch.fx.Node]] = {}
        for node, layer in zip(nodes[start:end], layers[start:end]):
            slot[node] = (seg, layer, len(by_layer.setdefault(layer, [])))
            by_layer[layer].append(node)
            if node.op == "get_attr":
                raise _Mismatch(f"layer {layer} reads a module attribute ({node.format_node()})")
            if node.op == "placeholder" and kinds[node.name].kind == "constant":
                raise _Mismatch(f"layer {layer} has a lifted constant ({node.name})")
        if len({len(b) for b in by_layer.values()}) != 1:
            raise _Mismatch(f"the layers of {path} have different numbers of nodes")
        blocks.append(by_layer)
    return slot, blocks


def synthesize(small: TracedModel, path: str, depth: int, ties: dict[str, str]) -> TracedModel:
    """The ``depth``-layer graph of the model ``small`` was traced from with fewer layers of
    its list at ``path`` (see the module docstring). Raises ``_Mismatch`` where the small graph
    is not made of whole layers in order."""
    gm = small.gm
    nodes = list(gm.graph.nodes)
    fqns = {i.name: i.fqn for i in small.inputs}
    kinds = {i.name: i for i in small.inputs}
    layers = _node_layers(nodes, fqns, path)
    have = max((x for x in layers if x is not None), default=-1) + 1
    if have < 2 or depth < have:
        raise _Mismatch(f"the small graph has {have} layers of {path}")
    runs = _segments(nodes, layers, have)
    template = have - 1
    slot, blocks = _blocks(nodes, layers, runs, kinds, path)
    out = _Emitter(small, slot, _Relayer(path, template, "."), _Relayer(path, template, "_"), template)
    emit = out.emit
    starts = {start: seg for seg, (start, _) in enumerate(runs)}
    i = 0
    while i < len(nodes):
        if i in starts:
            seg = starts[i]
            for layer in range(have):
                for node in blocks[seg][layer]:
                    emit(node, layer, 0)
            for layer in range(have, depth):
                for node in blocks[seg][template]:
                    emit(node, layer, layer - template)
            i = runs[seg][1]
            continue
        node = nodes[i]
        if node.op == "placeholder" or not any(a in slot for a in node.all_input_nodes):
            emit(node, None, 0)
        else:
            emit(node, None, depth - have)
        i += 1
    new_gm = _graph_module(gm, out.graph)
    return TracedModel(
        gm=new_gm,
        inputs=tuple(out.inputs),
        in_spec=small.in_spec,
        out_spec=small.out_spec,
        ties=ties,
        constants=out.constants,
        graph_hash=graph_hash(new_gm),
        notes=small.notes,
        carried=small.carried,
        sets=small.sets,
        checkpointing=small.checkpointing,
        checkpointed=_deepened(small.checkpointed, path, have, depth),
    )


def _deepened(checkpointed: tuple[str, ...], path: str, have: int, depth: int) -> tuple[str, ...]:
    """The modules the ``depth``-layer model checkpoints (``TracedModel.checkpointed``), from the
    ``have``-layer export's: the same modules in every layer where all ``have`` layers checkpoint the
    same ones, else () (every layer: a pattern by index, such as Hugging Face's ``every_n_layers``,
    is not known from a few layers)."""
    if not checkpointed:
        return ()
    prefix = path + "."
    inside: dict[str, set[str]] = {}
    for fqn in checkpointed:
        if fqn.startswith(prefix):
            index, _, rest = fqn[len(prefix) :].partition(".")
            inside.setdefault(index, set()).add(rest)
    rests = [inside.get(str(layer), set()) for layer in range(have)]
    if any(rest != rests[0] for rest in rests):
        return ()
    outside = [fqn for fqn in checkpointed if not fqn.startswith(prefix)]
    within = [f"{prefix}{layer}" + (f".{rest}" if rest else "") for layer in range(depth) for rest in sorted(rests[0])]
    return tuple(sorted(outside + within))


class _Emitter:
    """Copies nodes of the small graph into the deep one (``synthesize``): a node of a layer
    copied ``shift`` layers deeper reads the nodes of its layer, shifted alike, and is renamed
    to its new layer; a node outside the layers reads the copies of what it read."""

    def __init__(
        self,
        small: TracedModel,
        slot: dict[torch.fx.Node, tuple[int, int, int]],
        dotted: _Relayer,
        underscored: _Relayer,
        template: int,
    ):
        self.small, self.slot, self.dotted, self.underscored, self.template = small, slot, dotted, underscored, template
        self.kinds = {i.name: i for i in small.inputs}
        self.graph = torch.fx.Graph()
        self.graph._codegen = copy.deepcopy(small.gm.graph._codegen)
        self.made: dict[tuple[int, int, int], torch.fx.Node] = {}
        self.outside: dict[torch.fx.Node, torch.fx.Node] = {}
        self.inputs: list[GraphInput] = []
        self.constants: dict[str, torch.Tensor] = {}

    def _read(self, node: torch.fx.Node, arg: torch.fx.Node, layer: int | None, shift: int) -> torch.fx.Node:
        where = self.slot.get(arg)
        if where is None:
            return self.outside[arg]
        seg, at, pos = where
        if layer is not None and shift and at < self.template - 1:
            raise _Mismatch(f"{node.name} reads {arg.name}, {self.template - at} layers back")
        return self.made[(seg, at + shift, pos)]

    def emit(self, node: torch.fx.Node, layer: int | None, shift: int) -> None:
        def read(arg: torch.fx.Node) -> torch.fx.Node:
            return self._read(node, arg, layer, shift)

        renamed = layer is not None and shift != 0
        base = name_base(node.name)
        if renamed:
            base = self.underscored(layer, base)
        new = self.graph.create_node(
            node.op,
            node.target,
            torch.fx.node.map_arg(node.args, read),
            torch.fx.node.map_arg(node.kwargs, read),
            name=base,
            type_expr=node.type,
        )
        # Filled in place: assigning a node's meta re-indexes the node in its graph's lookup table.
        new.meta.update(node.meta)
        if renamed:
            _relayer_meta(new.meta, self.dotted, layer)
        if node.op == "placeholder":
            new.target = new.name  # a placeholder's target is its argument's name
            info = self.kinds[node.name]
            fqn = self.dotted(layer, info.fqn) if renamed and info.fqn else info.fqn
            self.inputs.append(GraphInput(new.name, info.kind, fqn))
            if info.kind == "constant":
                self.constants[new.name] = self.small.constants[node.name]
        if node in self.slot:
            seg, at, pos = self.slot[node]
            self.made[(seg, at + shift, pos)] = new
        else:
            self.outside[node] = new


def _relayer_meta(meta: dict, relayer: _Relayer, layer: int) -> None:
    """Put the module paths in ``meta`` (a copy of the template node's) to ``layer``'s."""
    stack = meta.get("nn_module_stack")
    if stack:
        meta["nn_module_stack"] = {relayer(layer, key): (relayer(layer, where), kind) for key, (where, kind) in stack.items()}
    own = meta.get("autopar")
    if own and isinstance(own.get("cast_of"), str):
        meta["autopar"] = {**own, "cast_of": relayer(layer, own["cast_of"])}


def _graph_module(root: torch.fx.GraphModule, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """A GraphModule whose Python code is generated only if something calls it (planning reads
    the graph; a deep model's code takes a second to generate)."""
    try:
        from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module
    except ImportError:  # older torch: generate it now
        return torch.fx.GraphModule(root, graph)
    with _use_lazy_graph_module(True):
        return _make_graph_module(root, graph)


def difference(built: TracedModel, real: TracedModel) -> str | None:
    """The first way ``built`` differs from ``real`` that planning could see, or None."""
    if built.graph_hash != real.graph_hash:
        for a, b in zip(built.gm.graph.nodes, real.gm.graph.nodes):
            if (a.name, a.op, str(a.target)) != (b.name, b.op, str(b.target)):
                return f"node {a.format_node()} is {b.format_node()} in the export"
        return f"graph hash {built.graph_hash} is {real.graph_hash} in the export"
    if built.inputs != real.inputs:
        return "the graph inputs or their FQNs differ"
    if built.ties != real.ties or set(built.constants) != set(real.constants):
        return "tied weights or lifted constants differ"
    if built.in_spec != real.in_spec or built.out_spec != real.out_spec:
        return "input or output structure differs"
    if (built.checkpointing, built.checkpointed) != (real.checkpointing, real.checkpointed):
        return f"the model checkpoints {real.checkpointed or 'every layer'}, not {built.checkpointed or 'every layer'}"
    for a, b in zip(built.gm.graph.nodes, real.gm.graph.nodes):
        for key in ("nn_module_stack", "autopar"):
            if a.meta.get(key) != b.meta.get(key):
                return f"{key} of {a.name}: {a.meta.get(key)} vs {b.meta.get(key)} in the export"
        va, vb = a.meta.get("val"), b.meta.get("val")
        if isinstance(vb, torch.Tensor) and (
            not isinstance(va, torch.Tensor) or va.requires_grad != vb.requires_grad or va.stride() != vb.stride()
        ):
            return f"the value of {a.name} differs in requires_grad or strides"
        if set(a.meta) != set(b.meta):
            return f"metadata keys of {a.name} differ"
    return None
