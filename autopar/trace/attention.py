"""Give attention back the causal flag that tracing turned into a mask (``causal_attention``).

Hugging Face models (and many hand-written ones) build a causal mask in forward, then call
``scaled_dot_product_attention`` with ``is_causal=True`` and no mask where they can see that the
mask is only causal. Export traces the construction instead (arange, comparisons, ``where``,
``masked_fill``, vmap's batched ops), so the graph calls SDPA with a materialized mask: the
planner prices a mask tensor, and the attention kernels take their slow masked path (cuDNN's
backward three times slower on an H200).

The pass proves a mask causal rather than recognizing how it was built. The mask's producing
subgraph must depend on no input of the graph (parameters, buffers and user inputs can change
between calls; only the traced shapes, literals and lifted constants cannot), and must draw no
random numbers. Then its value is the same at every call, so the pass computes it once for the
traced shapes, on the CPU, and compares it exactly with the mask that ``is_causal=True`` means
in torch: ``ones(L, S).tril()`` for L queries and S keys (aligned top-left, so a mask aligned
bottom-right when L != S is not that and stays). An additive mask counts as causal only when
its entries are 0 where the pattern allows and -inf or the dtype's lowest value (Hugging Face's
``finfo.min``) elsewhere: either makes a softmax weight exactly zero (the lowest value does so
for any score below 1e38 in magnitude). Anything else (a padding mask from ``attention_mask``, a
sliding window, a mask kept in a buffer) stays a mask, except a mask that masks nothing (all
allowed: an encoder's without padding), which is dropped as eager drops it. The values are computed in graph order, so
an in-place write (``mask.masked_fill_(...)``) lands as in eager, and one that writes data into
a constant makes it data; ops that read only their input's shape and dtype (``x.new_zeros(())``)
need no value for it.

A rewritten call keeps its dropout, scale and ``enable_gqa``: the causal pattern is over the
last two dims only, and a masked entry's weight is zero before dropout either way. A mask that
several layers share is rewritten in each; its construction is erased once nothing reads it (a
mask that also feeds another op keeps its construction for that op).
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx

log = logging.getLogger(__name__)

# The largest intermediate the pass computes, in bytes. A batch-expanded mask at long sequences
# can exceed it; that mask is left (and logged) rather than spend the host's memory on a proof.
MAX_BYTES = 2 << 30

_MASK_ARGUMENTS = ("attn_mask", "attn_bias")

# A mask built under ``torch.vmap`` traces to functorch's pre-dispatch calls: batch dims added
# and removed at a vmap level, between calls that enter and leave the level (run in graph order).
_VMAP_MODULE = "torch._functorch.predispatch"
_VMAP_LEVELS = set()
try:
    from torch._functorch import predispatch as _predispatch

    _VMAP_LEVELS = {_predispatch._vmap_increment_nesting, _predispatch._vmap_decrement_nesting}
except ImportError:  # older torch: vmap-built masks stay masks
    pass

# Ops that read only their first input's shape, dtype and device, which the trace fixes: an input
# that is data (``x.new_zeros(())``) still gives them a value.
_METADATA_ONLY = {"new_zeros", "new_ones", "new_full", "new_empty", "zeros_like", "ones_like", "full_like", "empty_like"}

# Ops whose output is uninitialized memory: a float one is filled with NaN (which no mask may
# hold, so a mask that reads it before writing is refused), any other has no value.
_UNINITIALIZED = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"}


def causal_attention(gm: torch.fx.GraphModule, constants: dict[str, torch.Tensor] | None = None) -> int:
    """Rewrite every SDPA call whose mask is provably the causal mask of its query and key
    positions to ``is_causal=True`` without a mask, drop every mask that provably masks nothing,
    and erase the mask construction nothing else reads. ``constants`` maps placeholder names of
    lifted constant tensors to their values (they may feed a mask); every other placeholder is
    data. Returns how many calls lost their mask."""
    calls = {node: found for node in gm.graph.nodes if (found := _masked_attention(node)) is not None}
    if not calls:
        return 0
    rewritten, masks = 0, []
    masks_of = {node: mask for node, (mask, _) in calls.items()}
    for node, (causal, reason) in _meanings(gm, masks_of, constants or {}):
        mask, mask_argument = calls[node]
        if reason is None:
            _drop_mask(node, mask_argument, causal)
            masks.append(mask)
            rewritten += causal
        else:
            log.debug("autopar: %s keeps its mask %s: %s", node.name, mask.name, reason)
    if rewritten:
        _erase_unread(gm.graph, masks)
        gm.recompile()
    log.info(
        "autopar: of %d masked attention calls, %d are causal (is_causal=True) and %d mask nothing: masks dropped",
        len(calls),
        rewritten,
        len(masks) - rewritten,
    )
    return len(masks)


# ``node.meta`` key of an SDPA call whose mask, computed from the graph's inputs, is the causal mask
# of its positions for the example inputs (``causal_for_the_example``).
EXAMPLE_MASK = "autopar_example_mask"


def causal_for_the_example(gm: torch.fx.GraphModule, constants: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor]) -> int:
    """Mark each ``aten.scaled_dot_product_attention`` call whose mask the graph computes from its
    inputs and which, for the example ``inputs`` (placeholder name → real tensor), is exactly the
    causal mask (``node.meta[EXAMPLE_MASK] = "causal"``): such a call keeps its mask in the graph
    (another batch may pad), and the runtime attends causally in the calls where the mask is
    causal (``ops.causal_mask``), so the cost model prices the example's kernel. A mask that needs
    a gradient stays a mask at run time and is not marked. Returns how many calls are marked."""
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    calls = {n: found[0] for n in gm.graph.nodes if n.target is sdpa and (found := _masked_attention(n)) is not None}
    calls = {n: mask for n, mask in calls.items() if not getattr(mask.meta.get("val"), "requires_grad", False)}
    if not calls or not inputs:
        return 0
    marked = 0
    for node, meaning in _meanings(gm, calls, {**constants, **inputs}):
        if meaning == (True, None):
            node.meta[EXAMPLE_MASK] = "causal"
            marked += 1
    log.info("autopar: %d attention calls attend causally for the example inputs (their mask is the causal one)", marked)
    return marked


def _meanings(
    gm: torch.fx.GraphModule, calls: dict[torch.fx.Node, torch.fx.Node], known: dict[str, torch.Tensor]
) -> Iterator[tuple[torch.fx.Node, tuple[bool, str | None]]]:
    """Each call of ``calls`` (call → its mask node) in graph order with ``_meaning`` of its mask,
    the graph's values computed on the way from the placeholders ``known`` names (``_Values``).
    The caller may rewrite a call it is handed (the walk holds the node list it started with)."""
    # In-place writes change what a later read sees, so they are computed too (with what they read).
    needed = ancestors(list(calls.values()) + [n for n in gm.graph.nodes if written(n)])
    values = _Values(gm, known)
    meanings: dict[Any, tuple[bool, str | None]] = {}  # every layer's call reads one mask: proved once
    try:
        for node in list(gm.graph.nodes):
            if node in calls:
                scores = _scores(node)  # (a symbolic size is not hashable: such a call is not proved anyway)
                key = (calls[node], scores) if all(isinstance(size, int) for size in scores) else None
                if key is None or key not in meanings:
                    meanings[key] = _meaning(values.get(calls[node]), node)
                yield node, meanings[key]
            elif node in needed or written(node) or node.target in _VMAP_LEVELS:
                values.evaluate(node)
                if written(node):  # an in-place write may change a mask already proved
                    meanings.clear()
    finally:
        values.leave_vmap()


def _masked_attention(node: torch.fx.Node) -> tuple[torch.fx.Node, str] | None:
    """For an SDPA call (any aten variant with a mask and an ``is_causal`` argument) that passes a
    mask tensor and is not already causal: the mask node and its argument's name."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    if target.namespace != "aten" or "scaled_dot_product" not in target._schema.name:
        return None
    names = [argument.name for argument in target._schema.arguments]
    mask_argument = next((name for name in _MASK_ARGUMENTS if name in names), None)
    if mask_argument is None or "is_causal" not in names:
        return None
    mask = _argument(node, mask_argument)
    if not isinstance(mask, torch.fx.Node) or _argument(node, "is_causal"):
        return None
    return mask, mask_argument


def _position(node: torch.fx.Node, name: str) -> int:
    return [argument.name for argument in node.target._schema.arguments].index(name)


def _argument(node: torch.fx.Node, name: str) -> Any:
    index = _position(node, name)
    if index < len(node.args):
        return node.args[index]
    return node.kwargs.get(name, node.target._schema.arguments[index].default_value)


def _set_argument(node: torch.fx.Node, name: str, value: Any) -> None:
    index = _position(node, name)
    if index < len(node.args):
        node.update_arg(index, value)
    else:
        node.update_kwarg(name, value)


def _drop_mask(node: torch.fx.Node, mask_argument: str, causal: bool) -> None:
    _set_argument(node, mask_argument, None)
    if causal:
        _set_argument(node, "is_causal", True)


def ancestors(nodes) -> set[torch.fx.Node]:
    """``nodes`` and every node they are computed from."""
    found: set[torch.fx.Node] = set()
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node not in found:
            found.add(node)
            stack.extend(node.all_input_nodes)
    return found


class _Values:
    """The values of the graph's constant nodes, computed in graph order on real CPU tensors (so
    an in-place write lands where eager's would). A node that reads an input, draws random
    numbers, or would be too large has no value, nor has a tensor that such a node writes."""

    def __init__(self, gm: torch.fx.GraphModule, constants: dict[str, torch.Tensor]):
        self.gm = gm
        self.constants = constants
        self.known: dict[torch.fx.Node, Any] = {}
        self.vmap_depth = 0  # vmap levels entered and not yet left

    def leave_vmap(self) -> None:
        """Leave the vmap levels a walk cut short left entered (functorch's state is global)."""
        while self.vmap_depth > 0:
            _predispatch._vmap_decrement_nesting()
            self.vmap_depth -= 1

    def get(self, node: torch.fx.Node) -> Any:
        return self.known.get(node)

    def evaluate(self, node: torch.fx.Node) -> None:
        value = self._compute(node)
        if value is not None:
            self.known[node] = value
            return
        for target in written(node):  # its new value is unknown, and so is every alias's
            self._forget(target)

    def _forget(self, node: torch.fx.Node) -> None:
        value = self.known.pop(node, None)
        if not isinstance(value, torch.Tensor):
            return
        try:
            storage = value.untyped_storage().data_ptr()
            aliases = [
                n for n, v in self.known.items() if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() == storage
            ]
        except (RuntimeError, NotImplementedError):  # a vmap-batched value has no plain storage
            aliases = list(self.known)
        for other in aliases:
            del self.known[other]

    def _compute(self, node: torch.fx.Node) -> Any:
        if node.op in ("placeholder", "get_attr"):
            return self._constant(node)
        if node.op != "call_function" or not _deterministic(node.target):
            return None
        if any(n not in self.known for n in node.all_input_nodes if not self._metadata_only(node, n)):
            return None
        if _too_large(node):
            return None
        if node.target in _VMAP_LEVELS:  # entered and left whatever the mask needs
            entering = node.target is _predispatch._vmap_increment_nesting
            if not entering and self.vmap_depth == 0:
                return None
            self.vmap_depth += 1 if entering else -1
            return node.target(*node.args, **node.kwargs)
        args, kwargs = torch.fx.node.map_aggregate((node.args, node.kwargs), self._concrete)
        if node.args and self._metadata_only(node, node.args[0]) and node.args[0] not in self.known:
            fake = node.args[0].meta["val"]  # its data is never read: a tensor of its kind stands in
            args = (torch.empty(fake.shape, dtype=fake.dtype), *args[1:])
        try:
            with torch.no_grad():
                value = node.target(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - an op that cannot run here proves nothing
            log.debug("autopar: cannot compute %s on the CPU: %s", node.format_node(), error)
            return None
        if isinstance(node.target, torch._ops.OpOverload) and node.target._schema.name.removeprefix("aten::") in _UNINITIALIZED:
            return value.fill_(float("nan")) if value.is_floating_point() else None
        return value

    def _constant(self, node: torch.fx.Node) -> torch.Tensor | None:
        """A lifted constant's or a graph attribute's value; None for data, and for a constant
        the graph writes in place (the next call would read the written value)."""
        value = self.constants.get(node.name) if node.op == "placeholder" else getattr(self.gm, node.target, None)
        if not isinstance(value, torch.Tensor) or any(node in written(user) for user in node.users):
            return None
        return value.detach().to("cpu", copy=True)

    @staticmethod
    def _metadata_only(node: torch.fx.Node, argument: Any) -> bool:
        target = node.target
        if not isinstance(target, torch._ops.OpOverload) or not node.args or argument is not node.args[0]:
            return False
        return target._schema.name.removeprefix("aten::") in _METADATA_ONLY

    def _concrete(self, value: Any) -> Any:
        if isinstance(value, torch.fx.Node):
            return self.known.get(value)
        if isinstance(value, torch.device):  # a meta or GPU trace: the mask is the same on the CPU
            return torch.device("cpu")
        return value


def _deterministic(target: Any) -> bool:
    if target is operator.getitem or getattr(target, "__module__", None) == _VMAP_MODULE:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False  # a higher-order op or a Python function: not looked into
    return torch.Tag.nondeterministic_seeded not in target.tags


def _too_large(node: torch.fx.Node) -> bool:
    values = node.meta.get("val")
    values = values if isinstance(values, (list, tuple)) else [values]
    for value in values:
        if isinstance(value, torch.Tensor):
            try:
                size = int(value.numel()) * value.element_size()
            except (TypeError, RuntimeError):  # a symbolic shape: not constant anyway
                return True
            if size > MAX_BYTES:
                log.info("autopar: %s is %d bytes, above the %d the mask proof computes", node.name, size, MAX_BYTES)
                return True
    return False


def _meaning(mask: Any, call: torch.fx.Node) -> tuple[bool, str | None]:
    """(True, None) where ``mask`` (a computed value, or None where the mask is data) is exactly the
    mask that ``is_causal=True`` means for ``call``'s query and key lengths, (False, None) where it
    masks nothing (an encoder's mask without padding), else (False, why it stays)."""
    if not isinstance(mask, torch.Tensor):
        return False, "its value depends on the graph's inputs or random numbers"
    if torch._C._functorch.is_batchedtensor(mask):
        return False, "the attention runs under torch.vmap"
    scores = _scores(call)
    if not all(isinstance(size, int) for size in scores):
        return False, f"the attention's shape {scores} is symbolic"
    try:
        if torch.broadcast_shapes(mask.shape, scores) != torch.Size(scores):
            return False, f"its shape {tuple(mask.shape)} broadcasts the scores {scores} to a larger shape"
    except RuntimeError:
        return False, f"its shape {tuple(mask.shape)} does not broadcast to the scores {scores}"
    allowed = allowed_positions(mask)
    if allowed is None:
        return False, "an additive mask with entries other than 0, -inf and the dtype's lowest value"
    if bool(allowed.all()):
        return False, None
    if is_causal_pattern(allowed, scores[-2], scores[-1]):
        return True, None
    return False, "it is neither the causal mask of the query and key positions nor empty (a window, padding, ...)"


def is_causal_pattern(allowed: torch.Tensor, queries: int, keys: int) -> bool:
    """Whether ``allowed`` (``allowed_positions``) is the mask ``is_causal=True`` means for
    ``queries`` × ``keys`` scores, in every leading index. Compared over the mask's own leading
    dims, not the scores' (batch × heads × q × k elements, billions for a large batch): each of
    the scores' entries reads one of these."""
    plane = (*allowed.shape[:-2], queries, keys)
    causal = torch.ones(queries, keys, dtype=torch.bool, device=allowed.device).tril()
    return torch.equal(allowed.expand(plane), causal.expand(plane))


def _scores(call: torch.fx.Node) -> tuple:
    """The shape of ``call``'s attention scores: the query's without its last dim, then the keys'."""
    query, key = _argument(call, "query").meta["val"], _argument(call, "key").meta["val"]
    return (*query.shape[:-1], key.shape[-2])


def _unexpanded(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` without the copies ``expand`` made (a dim of stride 0 kept at size 1): the same
    values once broadcast back, read at the cost of the elements the mask holds (Hugging Face
    expands its masks over the batch)."""
    for dim, (size, stride) in enumerate(zip(mask.shape, mask.stride())):
        if stride == 0 and size > 1:
            mask = mask.narrow(dim, 0, 1)
    return mask


def allowed_positions(mask: torch.Tensor) -> torch.Tensor | None:
    """The positions ``mask`` lets attend (its copies along expanded dims left out:
    ``_unexpanded``), or None for an additive mask that would shift scores."""
    mask = _unexpanded(mask)
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        return None
    blocked = (mask == float("-inf")) | (mask == torch.finfo(mask.dtype).min)
    if not bool(((mask == 0) | blocked).all()):
        return None
    return mask == 0


def _erase_unread(graph: torch.fx.Graph, masks: list[torch.fx.Node]) -> None:
    """Erase the masks and their producers that nothing reads any more, with the in-place writes
    into them that nothing reads either (``mask.masked_fill_(...)``). Other impure nodes stay."""
    stack, erased = list(masks), set()
    while stack:
        node = stack.pop()
        if node in erased or node.op != "call_function":
            continue
        if written(node):  # the mask was an in-place write's result: its target may now be dead
            stack.extend(written(node) if not node.users else ())
            continue
        if node.is_impure():
            continue
        writes = list(node.users)
        if not all(_dead_write(user, node) for user in writes):
            continue
        inputs = [n for user in writes for n in user.all_input_nodes] + node.all_input_nodes
        for user in writes:
            graph.erase_node(user)
        graph.erase_node(node)
        erased.add(node)
        stack.extend(inputs)


def _dead_write(user: torch.fx.Node, node: torch.fx.Node) -> bool:
    """Whether ``user`` only writes into ``node`` in place and nothing reads its result, with
    ``node`` not a view (a write into a view would land in its base, which others may read)."""
    if user.users or written(user) != [node]:
        return False
    returns = node.target._schema.returns if isinstance(node.target, torch._ops.OpOverload) else ()
    return node.target is not operator.getitem and not any(r.alias_info is not None for r in returns)


def written(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The tensors that ``node`` writes in place, by its schema's alias annotations."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return []
    found = []
    for index, argument in enumerate(target._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = node.args[index] if index < len(node.args) else node.kwargs.get(argument.name)
        if isinstance(value, torch.fx.Node):
            found.append(value)
    return found
