"""Schedule parameter communication: bucketed gradient reductions, FSDP gathers with prefetch.

``insert_collectives`` leaves, for every use of a parameter, the collectives of that edge:
``allreduce_grad`` chains on a replicated parameter (DDP's gradient all-reduce), or an
``all_gather`` followed by ``allreduce_grad`` on the same axis for a sharded one (whose backward
all-reduces the whole gradient and keeps a chunk). This pass replaces them, per parameter:

- every ``allreduce_grad`` chain over the same axes from the placeholder becomes one
  ``grad_buckets`` node (identity; backward adds the gradient into a bucket slot, reduced
  asynchronously with the rest of its bucket; the slot takes the chain's ``reduce_dtype``, a
  precision policy's, else the parameter's dtype);
- every ``all_gather(dim, g)`` → ``allreduce_grad(g)`` from the placeholder becomes one
  ``param_gathers`` node: all-gather in forward (prefetched), a reduce-scatter slot in backward,
  so the gradient stays sharded and half the bytes move. The parameters of one layer that are
  consecutive in forward order are gathered by one collective (``CommOptions.gather_group_bytes``),
  and a group is freed after forward and gathered again in backward as
  ``CommOptions.reshard_after_forward`` says (``ir.gathers``; the graph runs under
  ``saved_tensors_hooks(gm)``). Where the chain sums the gradient on other axes too (hybrid
  sharding, FSDP2's HSDP: sharded on one axis, replicated on others, the batch split on all),
  the slot reduce-scatters on the gather's axis, then all-reduces the shard on the others
  (``GradBuckets``: on the first of them as soon as the reduce-scatter is waited for, at the
  next bucket's launch, as FSDP2 does; the last bucket's and further axes' at the end of
  backward), in place of an all-reduce of the whole gradient per use on each axis.

Uses of other shapes keep their collectives (a parameter gathered over two axes, strided shards,
uses that reduce over different axes, a gather whose gradient is summed on other axes but not on
its own, offloaded parameters). Nothing is chosen here: the bucket
cap and the prefetch depth come from ``ir.options.CommOptions``, and the cost model prices the
same merging (``solver.comm_schedule``).

Under ``compiler="inductor"`` ``schedule_in_graph`` runs instead: the schedule stays in the
graph, where the compiler sees it. Each ``all_gather`` → ``allreduce_grad`` pair of a sharded
parameter becomes one ``gather_param`` (all-gather forward, reduce-scatter backward: FSDP's pair);
DDP's ``allreduce_grad`` chains stay (all-reduce in backward). Where the parameter's layer
reshards after forward (``CommOptions.reshard_after_forward``, ``ir.gathers.reshards``) it is
``gather_param_resharded``: the gather is marked for recomputation, so AOTAutograd's
partitioner gathers the parameter again in backward instead of keeping it (SimpleFSDP's way).
A post-grad pass then buckets these functional collectives (``passes.inductor_comm``, sized by
the same ``CommOptions``) and inductor moves their waits behind compute (``inductor_options``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import operator
from collections.abc import Mapping, Sequence

import torch
import torch.fx

from autopar.errors import PlanError
from autopar.ir.gathers import gather_groups, param_layer, reshards
from autopar.ir.options import CommOptions
from autopar.ir.plan import Plan
from autopar.ir.spec import local_shape, padded_axis
from autopar.ops import collectives
from autopar.ops.buckets import GradBuckets, ParamGathers, Slot, make_buckets
from autopar.passes.inductor_comm import bucket_pass
from autopar.trace import is_param_cast

GRAD_BUCKETS = "grad_buckets"
PARAM_GATHERS = "param_gathers"


def _is(node: torch.fx.Node, fn) -> bool:
    return node.op == "call_function" and node.target is fn


def _grad_chain(node: torch.fx.Node) -> tuple[list[torch.fx.Node], tuple[str, ...]]:
    """The ``allreduce_grad`` nodes that start at ``node`` (each the only user of the one
    before), and their groups; the chain's last node is what the use reads."""
    chain, groups = [], []
    current = node
    while _is(current, collectives.allreduce_grad):
        chain.append(current)
        groups.append(current.args[1])
        users = list(current.users)
        if len(users) != 1 or not _is(users[0], collectives.allreduce_grad):
            break
        current = users[0]
    return chain, tuple(groups)


def schedule_communication(
    gm: torch.fx.GraphModule,
    plan: Plan,
    groups: Sequence[str] = (),
    fqns: Mapping[str, str] | None = None,
    options: CommOptions | None = None,
) -> torch.fx.GraphModule:
    """Merge each parameter's collectives into the scheduled ones (see the module docstring).
    ``fqns`` maps parameter placeholder names to canonical FQNs; without it (the pipeline and
    ``autopar check`` run the passes without parameters to bind) the graph is left as it is."""
    options = options or CommOptions()
    if fqns is None:
        return gm
    padded = _padded_params(gm, plan, fqns)
    if not options.enabled:
        _refuse_padded(padded, "the communication schedule is off (CommOptions(enabled=False))")
        return gm
    graph = gm.graph
    # Stand-ins, so that call_module nodes resolve while the real modules are being sized.
    gm.add_submodule(GRAD_BUCKETS, torch.nn.Module())
    gm.add_submodule(PARAM_GATHERS, torch.nn.Module())
    reduce_slots: list[tuple[int, Slot]] = []
    gathers: list[tuple[int, str, str, int, int, str, torch.dtype, int]] = []
    sizes: dict[str, int] = {}  # padded shards' unpadded dim sizes (``ParamGathers.sizes``)
    size_of = {name: math.prod(plan.mesh_shape[i] for i, g in enumerate(groups) if g == name) for name in groups}
    offloaded = set(plan.memory.offloaded("param")) if plan.memory is not None else set()
    _sync_lookups_at_the_table(graph, {name for name, fqn in fqns.items() if fqn not in offloaded})
    order = {node: i for i, node in enumerate(graph.nodes)}
    for placeholder in [n for n in graph.nodes if n.op == "placeholder" and n.name in fqns]:
        if fqns[placeholder.name] in offloaded:  # its gradient goes to the offload store
            if placeholder.name in padded:
                _refuse_padded({placeholder.name: padded[placeholder.name]}, "the plan offloads it")
            continue
        val = placeholder.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        local = local_shape(tuple(val.shape), plan.params[fqns[placeholder.name]], plan.mesh_shape)
        synced, gathered = _param_uses(placeholder, lenient=placeholder.name in padded)
        # (a policy's cast moved past its gathers leaves an unused alias of the padded piece: ``_used``;
        # a tied parameter's second placeholder, which the graph never reads, moves nothing)
        used = _used(placeholder)
        if (
            placeholder.name in padded
            and used
            and not (len(gathered) == 1 and not synced and len(used) == len(next(iter(gathered.values()))))
        ):
            _refuse_padded({placeholder.name: padded[placeholder.name]}, "a use of it is not one all-gather on its axis")
        if len(synced) == 1:  # one set of axes for every synced use (else: keep per-use collectives)
            ((chain_groups, chains),) = synced.items()
            first, slot_dtype = _merge_synced(graph, placeholder, chains, order)
            alone = len(placeholder.users) == 1  # every use of it is synced: only the bucket writes its .grad
            slot = Slot(placeholder.name, "all_reduce", local, slot_dtype, chain_groups, alone=alone)
            reduce_slots.append((first, slot))
        if len(gathered) == 1 and not synced:
            (((dim, group, reduced), pairs),) = gathered.items()
            first, slot_dtype, node = _merge_gathered(graph, placeholder, pairs, bool(reduced), order)
            moves = cast_dtype(node) or val.dtype  # ``gather_in_param_dtype`` gathers the cast
            whole = tuple(s * size_of[group] if d == dim else s for d, s in enumerate(local))  # padded: k pieces
            size = val.shape[dim] if placeholder.name in padded else -1
            if size >= 0:
                sizes[placeholder.name] = size
            if reduced:
                reduce_slots.append((first, Slot(placeholder.name, "reduce_scatter", whole, slot_dtype, reduced, dim, size=size)))
            gathers.append(
                (
                    first,
                    placeholder.name,
                    group,
                    dim,
                    math.prod(whole) * val.dtype.itemsize,
                    param_layer(fqns[placeholder.name]),
                    moves,
                    math.prod(whole) * moves.itemsize,
                )
            )
    _install_schedule(gm, reduce_slots, sorted(gathers), options, sizes)
    return gm


def _padded_params(gm: torch.fx.GraphModule, plan: Plan, fqns: Mapping[str, str]) -> dict[str, str]:
    """Placeholder name -> FQN of each parameter the plan holds as a padded shard
    (``ir.spec.padded_axis``)."""
    found = {}
    for node in gm.graph.nodes:
        val = node.meta.get("val") if node.op == "placeholder" and node.name in fqns else None
        spec = plan.params.get(fqns[node.name]) if val is not None else None
        if (
            isinstance(val, torch.Tensor)
            and spec is not None
            and padded_axis(tuple(val.shape), spec, plan.mesh_shape) is not None
        ):
            found[node.name] = fqns[node.name]
    return found


def refuse_padded_params(gm: torch.fx.GraphModule, plan: Plan, fqns: Mapping[str, str], why: str) -> None:
    """Refuse a plan that holds a parameter of ``gm`` as a padded shard where the runtime cannot
    move one (``why``: a pipeline, say)."""
    _refuse_padded(_padded_params(gm, plan, fqns), why)


def _refuse_padded(padded: Mapping[str, str], why: str) -> None:
    """A padded shard moves only through the scheduled gathers (``ParamGathers``, whose pieces are
    padded to equal sizes): refuse a graph that would move one with a plain collective."""
    if padded:
        names = ", ".join(sorted(padded.values())[:4]) + (" ..." if len(padded) > 4 else "")
        raise PlanError(
            f"the plan holds {names} as padded shards (Shard(0) on a mesh axis that does not divide dim 0, "
            f"FSDP2's uneven layout), but {why}, and only the scheduled FSDP gather pads them. Keep the "
            "communication schedule on (CommOptions()), or plan again on a mesh whose sizes divide the dims"
        )


def _used(node: torch.fx.Node, lenient: bool = True) -> list[torch.fx.Node]:
    """``node``'s users but (where ``lenient``) the unused aliases ``passes.precision`` keeps for
    a moved cast's name, which read a gather without needing it."""
    return [u for u in node.users if not (lenient and u.target is torch.ops.aten.alias.default and not u.users)]


def _param_uses(placeholder: torch.fx.Node, lenient: bool = False) -> tuple[dict, dict]:
    """A parameter's uses by their collectives: ``allreduce_grad`` chains by their groups, and
    ``all_gather`` → ``allreduce_grad`` pairs by (dim, group, the groups the gradient is summed
    over: the gather's first, then the chain's others in its order, as hybrid sharding sums a
    shard sharded on one axis and replicated on others; () where it is not reduced).
    ``lenient`` (a padded shard's, which only the scheduled gather moves): a gather may also feed
    unused aliases (``_used``), and one whose gradient is summed on other axes only (replicated
    there, sharded where the batch is whole: a rank keeps its rows of the sum) is scheduled too,
    its chain left in the graph to sum the whole gradient."""
    synced: dict[tuple[str, ...], list[list[torch.fx.Node]]] = {}
    gathered: dict[tuple[int, str, tuple[str, ...]], list[tuple[torch.fx.Node, torch.fx.Node]]] = {}
    for user in list(placeholder.users):
        chain, chain_groups = _grad_chain(user)
        if chain:
            synced.setdefault(chain_groups, []).append(chain)
            continue
        if _is(user, collectives.all_gather) and len(user.args) == 3 and len(_used(user, lenient)) == 1:
            (after,) = _used(user, lenient)
            chain, chain_groups = _grad_chain(after)
            group = user.args[2]
            if group in chain_groups and len(set(chain_groups)) == len(chain_groups):
                # partial gradient: reduce-scatter it on the gather's axis, then sum the shard on the others
                reduced = (group, *(g for g in chain_groups if g != group))
                gathered.setdefault((user.args[1], group, reduced), []).append((user, chain[-1]))
            elif not chain or lenient:
                # whole gradient on every rank: keep the local chunk; or (a padded shard's, which
                # only the scheduled gather moves) summed on other axes first, whole, by its chain
                gathered.setdefault((user.args[1], group, ()), []).append((user, user))
    return synced, gathered


def _merge_synced(
    graph: torch.fx.Graph, placeholder: torch.fx.Node, chains: list[list[torch.fx.Node]], order: Mapping[torch.fx.Node, int]
) -> tuple[int, torch.dtype]:
    """One ``grad_buckets`` node for every synced use; (where the first use was, the slot's dtype)."""
    first = min(order[chain[0]] for chain in chains)
    with graph.inserting_after(placeholder):
        node = graph.call_module(GRAD_BUCKETS, (placeholder,), {"key": placeholder.name})
    node.meta = dict(placeholder.meta)
    slot_dtype = _reduce_dtype(chains[0], placeholder.meta["val"])
    for chain in chains:
        chain[-1].replace_all_uses_with(node)
        for dead in reversed(chain):
            graph.erase_node(dead)
    return first, slot_dtype


def _merge_gathered(
    graph: torch.fx.Graph,
    placeholder: torch.fx.Node,
    pairs: list[tuple[torch.fx.Node, torch.fx.Node]],
    reduce: bool,
    order: Mapping[torch.fx.Node, int],
) -> tuple[int, torch.dtype, torch.fx.Node]:
    """One ``param_gathers`` node before the first gathered use; (its place, the slot's dtype, it)."""
    val = placeholder.meta["val"]
    first_use = min(pairs, key=lambda pair: order[pair[0]])[0]
    with graph.inserting_before(first_use):
        node = graph.call_module(PARAM_GATHERS, (placeholder,), {"key": placeholder.name})
    node.meta = dict(first_use.meta)
    slot_dtype = _reduce_dtype(_grad_chain(_used(pairs[0][0])[0])[0], val) if reduce else val.dtype
    for gather, last in pairs:
        last.replace_all_uses_with(node)
        if reduce:
            chain, _ = _grad_chain(_used(gather)[0])
            for dead in reversed(chain):
                graph.erase_node(dead)
        elif gather is not last:
            raise AssertionError("unreduced gather has no gradient chain")
        gather.replace_all_uses_with(node)  # an unused alias of it (``_used``) reads the gathered one
        graph.erase_node(gather)
    return order[first_use], slot_dtype, node


def cast_dtype(node: torch.fx.Node) -> torch.dtype | None:
    """The dtype that every user of ``node`` casts it to, where each is a parameter's cast and they
    agree (a scheduled gather's: ``passes.precision.gather_in_param_dtype`` then gathers in it), else None."""
    casts = list(node.users)
    dtypes = {cast.kwargs.get("dtype") for cast in casts}
    if casts and all(is_param_cast(cast) for cast in casts) and len(dtypes) == 1:
        return dtypes.pop()
    return None


def _install_schedule(
    gm: torch.fx.GraphModule,
    reduce_slots: list[tuple[int, Slot]],
    gathers: list[tuple],
    options: CommOptions,
    sizes: Mapping[str, int] | None = None,
) -> None:
    """Size the real ``GradBuckets`` and ``ParamGathers`` modules (``gathers`` in forward order)."""
    # grouped by the bytes they move (a policy's cast gathers in ``param_dtype``), as the cost model groups them
    groups_of_keys = gather_groups(
        [(key, layer, (group, dtype), moved) for _, key, group, _, _, layer, dtype, moved in gathers], options.gather_group_bytes
    )
    # A reduce-scatter bucket stays inside one gather group (ops.buckets: its input is freed
    # when the next one launches, as the memory walk prices it: cost.liveness.gathered_intervals).
    group_index = {key: gi for gi, keys in enumerate(groups_of_keys) for key in keys}
    reduce_slots = [
        (first, dataclasses.replace(slot, group=group_index[slot.key]) if slot.kind == "reduce_scatter" else slot)
        for first, slot in reduce_slots
    ]
    # Backward produces gradients in the reverse of forward order.
    slots = [slot for _, slot in sorted(reduce_slots, key=lambda item: -item[0])]
    buckets = GradBuckets(make_buckets(slots, options.bucket_cap_bytes, options.first_bucket_cap_bytes))
    gm.add_submodule(GRAD_BUCKETS, buckets)
    _one_node_per_bucket(gm.graph, buckets)
    layer_of = {g[1]: g[5] for g in gathers}
    reshard = [reshards(layer_of[keys[0]], options.reshard_after_forward) for keys in groups_of_keys]
    gm.add_submodule(
        PARAM_GATHERS,
        ParamGathers(
            [g[1:5] for g in gathers], options.prefetch_bytes, buckets, groups=groups_of_keys, reshard=reshard, sizes=sizes
        ),
    )
    if not reduce_slots:
        delattr(gm, GRAD_BUCKETS)
    if not gathers:
        delattr(gm, PARAM_GATHERS)


def _one_node_per_bucket(graph: torch.fx.Graph, buckets: GradBuckets) -> None:
    """The per-parameter ``grad_buckets`` nodes of each all-reduce bucket become one node that
    takes all its parameters (``GradBuckets.forward``), placed after the graph's inputs, and a
    ``getitem`` per parameter: one autograd node a bucket instead of one a parameter, the host
    time DDP's hooks on ``AccumulateGrad`` do not pay either."""
    nodes = {n.kwargs["key"]: n for n in graph.nodes if n.op == "call_module" and n.target == GRAD_BUCKETS}
    if not nodes:
        return
    first_op = [n for n in graph.nodes if n.op == "placeholder"][-1].next  # after every input
    while first_op in nodes.values():  # (a parameter's own node, erased below)
        first_op = first_op.next
    for bucket in buckets.buckets:
        keys = tuple(slot.key for slot in bucket.slots if slot.key in nodes)
        if not keys:
            continue  # a reduce-scatter bucket: its gradients come from the gathers' backward
        with graph.inserting_before(first_op):
            group = graph.call_module(GRAD_BUCKETS, tuple(nodes[key].args[0] for key in keys), {"keys": keys})
            group.meta["val"] = tuple(nodes[key].meta.get("val") for key in keys)
            for index, key in enumerate(keys):
                item = graph.call_function(operator.getitem, (group, index))
                item.meta = dict(nodes[key].meta)
                nodes[key].replace_all_uses_with(item)
                graph.erase_node(nodes[key])


def schedule_in_graph(
    gm: torch.fx.GraphModule,
    plan: Plan,
    groups: Sequence[str] = (),
    fqns: Mapping[str, str] | None = None,
    options: CommOptions | None = None,
) -> torch.fx.GraphModule:
    """The compiled mode's schedule (module docstring): gathers whose gradient is reduced on the
    same axis become ``gather_param``, or ``gather_param_resharded`` where the parameter's layer
    reshards after forward (``ir.gathers.reshards``); the reductions on the chain's other axes
    (hybrid sharding) move before it, onto the shard; bucketing and overlap are inductor's
    (``inductor_options``)."""
    options = options or CommOptions()
    if fqns is None or not options.enabled:
        return gm
    _refuse_padded(_padded_params(gm, plan, fqns), 'compiler="inductor" traces its gathers unpadded')
    graph = gm.graph
    _sync_lookups_at_the_table(graph, set(fqns))
    for placeholder in [n for n in graph.nodes if n.op == "placeholder" and n.name in fqns]:
        _one_sync_per_param(graph, placeholder)
        layer = param_layer(fqns[placeholder.name])
        gather_fn = (
            collectives.gather_param_resharded if reshards(layer, options.reshard_after_forward) else collectives.gather_param
        )
        for gather in list(placeholder.users):
            if not (_is(gather, collectives.all_gather) and len(gather.args) == 3 and len(gather.users) == 1):
                continue
            chain, chain_groups = _grad_chain(next(iter(gather.users)))
            if gather.args[2] not in chain_groups or len(set(chain_groups)) != len(chain_groups):
                continue
            own = chain[chain_groups.index(gather.args[2])]
            with graph.inserting_before(gather):
                # The chain's other axes (a parameter replicated on them: hybrid sharding) sum the
                # shard's gradient, after the reduce-scatter: their allreduce_grad moves onto the shard.
                shard = placeholder
                for node in chain:
                    if node is not own:
                        shard = graph.call_function(node.target, (shard, *node.args[1:]), dict(node.kwargs))
                        shard.meta = dict(placeholder.meta)
                kwargs = {"reduce_dtype": own.kwargs.get("reduce_dtype"), "layer": layer}
                node = graph.call_function(gather_fn, (shard, *gather.args[1:]), kwargs)
            node.meta = dict(gather.meta)
            chain[-1].replace_all_uses_with(node)
            for dead in reversed(chain):
                graph.erase_node(dead)
            graph.erase_node(gather)
    return gm


def _one_sync_per_param(graph: torch.fx.Graph, placeholder: torch.fx.Node) -> None:
    """A parameter used more than once (a tied embedding and head) with the same
    ``allreduce_grad`` chain on each use gets one chain for all of them: its gradient is summed
    over the uses, then reduced once, as the eager schedule's one bucket slot per parameter
    does, instead of one all-reduce of the whole gradient per use."""
    chains: dict[tuple, list[list[torch.fx.Node]]] = {}
    for user in list(placeholder.users):
        chain, chain_groups = _grad_chain(user)
        if chain:
            chains.setdefault((chain_groups, tuple(node.kwargs.get("reduce_dtype") for node in chain)), []).append(chain)
    if len(chains) != 1 or len(next(iter(chains.values()))) < 2:
        return
    ((kept, *others),) = chains.values()
    for chain in others:
        chain[-1].replace_all_uses_with(kept[-1])
        for dead in reversed(chain):
            graph.erase_node(dead)
    # the kept chain must come before every use it now feeds
    order = {node: i for i, node in enumerate(graph.nodes)}
    with graph.inserting_before(min(kept[-1].users, key=order.__getitem__)):
        previous = placeholder
        for node in kept:
            moved = graph.call_function(node.target, (previous,) + tuple(node.args[1:]), dict(node.kwargs))
            moved.meta = dict(node.meta)
            previous = moved
    kept[-1].replace_all_uses_with(previous)
    for dead in reversed(kept):
        graph.erase_node(dead)


def inductor_options(options: CommOptions | None = None, exchange_sums: bool = False) -> dict[str, object]:
    """Inductor's settings for the compiled mode: the bucketing of all-reduces, all-gathers and
    reduce-scatters, capped as ``CommOptions`` caps the eager buckets (``passes.inductor_comm``;
    with ``exchange_sums``, gloo's, reduce-scatters run as an all-to-all and a sum), and
    inductor's reordering of collectives and their waits around compute (the prefetch of
    gathers and the overlap of gradient reductions)."""
    options = options or CommOptions()
    if not options.enabled:
        return {}
    return {
        "post_grad_custom_post_pass": bucket_pass(options, exchange_sums),
        "reorder_for_compute_comm_overlap": True,
        "reorder_for_compute_comm_overlap_passes": [
            "reorder_communication_preserving_peak_memory",
            "sink_waits_iterative",
            "reorder_communication_preserving_peak_memory",
        ],
    }


def _reduce_dtype(chain: Sequence[torch.fx.Node], val: torch.Tensor) -> torch.dtype:
    """The dtype a parameter's gradient is reduced in: what its ``allreduce_grad`` chain asks
    for (a precision policy's ``reduce_dtype``, set by ``passes.precision``), else its own."""
    return (chain[0].kwargs.get("reduce_dtype") if chain else None) or val.dtype


def _sync_lookups_at_the_table(graph: torch.fx.Graph, params: set[str]) -> None:
    """Move an ``allreduce_grad`` chain from the output of an embedding lookup of a parameter
    (with indices that need no gradient) onto the parameter itself.

    A lookup table's gradient is linear in the output's gradient, so reducing it after the
    embedding backward sums the same values as reducing before. The reduction then joins the
    parameter's bucket slot (asynchronous, one latency per bucket) instead of running on its own
    at the end of backward: a positional embedding added to a batch-split activation is the case
    (its rows are looked up with the same positions on every rank). Forward is unchanged."""
    for node in list(graph.nodes):
        if not _is(node, collectives.allreduce_grad):
            continue
        lookup = node.args[0]
        if not (
            isinstance(lookup, torch.fx.Node)
            and lookup.op == "call_function"
            and lookup.target is torch.ops.aten.embedding.default
            and len(lookup.users) == 1
        ):
            continue
        table, indices = lookup.args[0], lookup.args[1]
        sparse = (len(lookup.args) > 4 and lookup.args[4]) or lookup.kwargs.get("sparse", False)
        if sparse or not (isinstance(table, torch.fx.Node) and table.op == "placeholder" and table.name in params):
            continue
        val = indices.meta.get("val") if isinstance(indices, torch.fx.Node) else None
        if val is None or val.is_floating_point() or val.requires_grad:
            continue
        chain, _ = _grad_chain(node)
        last = chain[-1]
        last.replace_all_uses_with(lookup)
        previous = table
        for sync in chain:  # the same chain, now between the table and the lookup
            with graph.inserting_before(lookup):
                moved = graph.call_function(collectives.allreduce_grad, (previous,) + tuple(sync.args[1:]), dict(sync.kwargs))
            moved.meta = dict(table.meta)
            previous = moved
        lookup.replace_input_with(table, previous)
        for dead in reversed(chain):
            graph.erase_node(dead)


def saved_tensors_hooks(gm: torch.fx.GraphModule) -> contextlib.AbstractContextManager:
    """The context to run ``gm``'s forward in: its first parameter gathers launch on entry, and
    its resharded ones are freed after forward (``ParamGathers.saved_tensors_hooks``); a no-op
    for a graph without them."""
    gathers = getattr(gm, PARAM_GATHERS, None)
    if isinstance(gathers, ParamGathers):
        return gathers.saved_tensors_hooks()
    return contextlib.nullcontext()


def bind_parameters(gm: torch.fx.GraphModule, params: Mapping[str, torch.Tensor]) -> None:
    """Give the scheduling modules of ``gm`` (and of its outlined segments) this rank's
    parameters, by placeholder name."""
    for module in gm.modules():
        if isinstance(module, (GradBuckets, ParamGathers)):
            module.bind(dict(params))
