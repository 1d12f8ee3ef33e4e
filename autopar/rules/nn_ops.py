"""Sharding rules for nn ops that the training IR keeps whole: softmax, norms, embedding,
attention, cross entropy, convolution, batch norm, pooling and dropout.

Most of these are "independent along some dims": shard a batch-like dim of every input that has
it and the output follows. The rows that need more than the op on local shards (a vocab-split
embedding, a loss mean over a global count, batch statistics over a sharded batch, a bias
under a split contraction) name a kernel from ``autopar.ops.parallel``.
"""

from __future__ import annotations

import torch

from autopar.ir.spec import P, R, S
from autopar.rules.pointwise import broadcast_shard, is_tensor, out_placement, row_by_name, shard_rows
from autopar.rules.registry import OpInfo, Row, register, replicate_row

aten = torch.ops.aten


@register(aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default)
def softmax_rule(info: OpInfo) -> list[Row]:
    ndim = info.inputs[0].ndim
    softmax_dim = info.kw["dim"] % max(ndim, 1)
    return [replicate_row(info)] + [Row((S(d),), S(d)) for d in range(ndim) if d != softmax_dim]


def _leading_dim_rows(info: OpInfo, num_normalized: int) -> list[Row]:
    """Norms over the trailing ``num_normalized`` dims: shard a leading dim of the input (and of
    every output); weight and bias stay R."""
    x = info.kw["input"]
    rows = [replicate_row(info)]
    for dim in range(x.ndim - num_normalized):
        rows.append(row_by_name(info, {"input": S(dim)}, out_placement(info, S(dim))))
    return rows


@register(aten.layer_norm.default, aten.native_layer_norm.default, aten.rms_norm.default)
def layer_norm_rule(info: OpInfo) -> list[Row]:
    return _leading_dim_rows(info, len(info.kw["normalized_shape"]))


@register(aten.embedding.default)
def embedding_rule(info: OpInfo) -> list[Row]:
    # weight[V, E], indices[...] -> out[..., E]; inputs are (weight, indices)
    indices = info.kw["indices"]
    rows = [Row((R, R), R)]
    rows += [Row((R, S(d)), S(d)) for d in range(indices.ndim)]
    rows.append(Row((S(1), R), S(info.out_ndim - 1)))
    # Vocab split: each rank looks up the rows it holds and writes zeros elsewhere. The kernel
    # cannot honour scale_grad_by_freq (frequencies would count other ranks' rows) or sparse.
    if not info.kw.get("scale_grad_by_freq") and not info.kw.get("sparse"):
        rows.append(Row((S(0), R), P, kernel="embedding_vocab_split"))
    return rows


@register(aten.scaled_dot_product_attention.default)
def sdpa_rule(info: OpInfo) -> list[Row]:
    # q[..., Tq, D], k[..., Tk, D], v[..., Tk, Dv], attn_mask broadcastable to [..., Tq, Tk]
    q, k, v = info.kw["query"], info.kw["key"], info.kw["value"]
    mask = info.kw["attn_mask"] if is_tensor(info, "attn_mask") else None
    scores_shape = tuple(q.shape[:-1]) + (k.shape[-2],)
    rows = [replicate_row(info)]
    if not (q.ndim == k.ndim == v.ndim):
        return rows
    # With dropout_p > 0 each rank draws its own attention-dropout mask, as for dropout below.
    gqa = bool(info.kw.get("enable_gqa"))
    for dim in range(q.ndim - 2):
        # Grouped-query attention maps query head h to kv head h // group; equal chunks of both
        # keep that map local, so the head dim shards even when the sizes differ.
        if k.shape[dim] == q.shape[dim] or (gqa and dim == q.ndim - 3):
            kv = S(dim)
        elif k.shape[dim] == 1 and v.shape[dim] == 1:
            kv = R
        else:
            continue
        placements = {"query": S(dim), "key": kv, "value": kv}
        if mask is not None:
            placements["attn_mask"] = broadcast_shard(mask, scores_shape, dim)
        rows.append(row_by_name(info, placements, S(dim)))
    # Query-sequence split (each rank attends its queries to every key). With is_causal the
    # mask is built from local shapes, which would be wrong on every rank but the first: causal
    # attention splits its sequence through the context-parallel kernel below instead.
    if not info.kw.get("is_causal"):
        placements = {"query": S(q.ndim - 2)}
        if mask is not None:
            placements["attn_mask"] = broadcast_shard(mask, scores_shape, q.ndim - 2)
        rows.append(row_by_name(info, placements, S(q.ndim - 2)))
    # Context parallelism for causal self-attention: q, k and v all split along the sequence;
    # the kernel gathers K/V and masks by global positions (``ops.attention``). Its backward
    # recomputes the attention, which would draw a second dropout mask, hence dropout_p == 0.
    seq = q.ndim - 2
    if (
        info.kw.get("is_causal")
        and mask is None
        and not info.kw.get("dropout_p")
        and q.shape[seq] == k.shape[seq] == v.shape[seq]
    ):
        ins = row_by_name(info, {"query": S(seq), "key": S(seq), "value": S(seq)}, S(seq)).ins
        rows.append(Row(ins, S(seq), kernel="sdpa_context_parallel"))
    return rows


@register(aten.cross_entropy_loss.default)
def cross_entropy_rule(info: OpInfo) -> list[Row]:
    # self[N, C, d...] (or [C]), target[N, d...] class indices or [N, C, d...] probabilities
    logits, target = info.kw["self"], info.kw["target"]
    reduction = info.kw["reduction"]
    rows = [replicate_row(info)]
    if logits.ndim < 2:
        return rows
    probabilities = target.ndim == logits.ndim
    has_weight = is_tensor(info, "weight")
    # Loss dims: batch and spatial dims, i.e. every dim of self but the class dim 1.
    for dim in [0] + list(range(2, logits.ndim)):
        target_dim = dim if probabilities or dim == 0 else dim - 1
        placements = {"self": S(dim), "target": S(target_dim)}
        if reduction == 0:
            rows.append(row_by_name(info, placements, S(0 if dim == 0 else dim - 1)))
        elif reduction == 2:
            rows.append(row_by_name(info, placements, P))
        elif reduction == 1 and (info.kw["label_smoothing"] == 0 or not has_weight):
            rows.append(Row(row_by_name(info, placements, P).ins, R, kernel="cross_entropy_mean"))  # whole: one all-reduce
    if logits.ndim == 2 and not probabilities and not has_weight and info.kw["label_smoothing"] == 0:
        # Vocab-parallel: logits split by class, targets whole; the kernel all-reduces [N] vectors.
        ins = row_by_name(info, {"self": S(1), "target": R}, R).ins
        rows.append(Row(ins, R, kernel="cross_entropy_vocab_split"))
    return rows


def _conv_rows(info: OpInfo, bias_kernel: str | None) -> list[Row]:
    # input[N, C_in, *spatial] (or unbatched [C_in, *spatial]), weight[C_out, C_in / groups, *k]
    x, weight = info.kw["input"], info.kw["weight"]
    has_bias = is_tensor(info, "bias")
    batched = x.ndim == weight.ndim
    channel = 1 if batched else 0

    def row(x_p, w_p, b_p, out, kernel=None) -> Row:
        whole = (2,) if kernel else ()  # the bias-split kernel leaves the bias gradient whole
        return Row((x_p, w_p, b_p) if has_bias else (x_p, w_p), out, kernel, whole)

    rows = [row(R, R, R, R)]
    if batched:
        rows.append(row(S(0), R, R, S(0)))
    if info.kw["groups"] == 1:
        rows.append(row(R, S(0), S(0), S(channel)))  # output channels
        if not has_bias:
            rows.append(row(S(channel), S(1), R, P))  # input channels: a split contraction
        elif bias_kernel is not None:
            rows.append(row(S(channel), S(1), R, P, bias_kernel))
        rows.append(row(S(channel), S(1), P, P))
    rows.append(row(P, R, P, P))  # convolution is linear in the input
    return rows


@register(aten.conv2d.default)
def conv2d_rule(info: OpInfo) -> list[Row]:
    return _conv_rows(info, "conv2d_bias_split")


@register(aten.conv1d.default, aten.conv3d.default)
def conv_rule(info: OpInfo) -> list[Row]:
    return _conv_rows(info, None)


@register(aten.batch_norm.default)
def batch_norm_rule(info: OpInfo) -> list[Row]:
    # input[N, C, *spatial]; weight, bias, running_mean, running_var are [C] or None
    x = info.kw["input"]
    per_channel = [n for n in ("weight", "bias", "running_mean", "running_var") if is_tensor(info, n)]
    rows = [replicate_row(info)]
    if x.ndim < 2:
        return rows
    channels = {"input": S(1), **{name: S(0) for name in per_channel}}
    rows.append(row_by_name(info, channels, S(1)))
    for dim in [0] + list(range(2, x.ndim)):
        row = row_by_name(info, {"input": S(dim)}, S(dim))
        if info.kw["training"]:
            # Batch statistics span every rank's slice: the kernel all-reduces them.
            row = Row(row.ins, row.out, kernel="sync_batch_norm")
        rows.append(row)
    return rows


def _pool_rows(info: OpInfo, spatial: int, linear: bool) -> list[Row]:
    """Pooling over the last ``spatial`` dims: batch and channel dims shard freely; average
    pools are linear, so P passes."""
    ndim = info.inputs[0].ndim
    rows = [replicate_row(info)]
    rows += [Row((S(d),), out_placement(info, S(d))) for d in range(ndim - spatial)]
    if linear:
        rows.append(Row((P,), P))
    return rows


@register(aten.max_pool2d.default, aten.max_pool2d_with_indices.default, aten.adaptive_max_pool2d.default)
def max_pool2d_rule(info: OpInfo) -> list[Row]:
    return _pool_rows(info, 2, linear=False)


@register(aten.max_pool1d.default)
def max_pool1d_rule(info: OpInfo) -> list[Row]:
    return _pool_rows(info, 1, linear=False)


@register(aten.max_pool3d.default)
def max_pool3d_rule(info: OpInfo) -> list[Row]:
    return _pool_rows(info, 3, linear=False)


@register(aten.avg_pool2d.default, aten.adaptive_avg_pool2d.default, aten._adaptive_avg_pool2d.default)
def avg_pool2d_rule(info: OpInfo) -> list[Row]:
    return _pool_rows(info, 2, linear=True)


@register(aten.avg_pool1d.default, aten.adaptive_avg_pool1d.default)
def avg_pool1d_rule(info: OpInfo) -> list[Row]:
    return _pool_rows(info, 1, linear=True)


@register(aten.avg_pool3d.default, aten.adaptive_avg_pool3d.default)
def avg_pool3d_rule(info: OpInfo) -> list[Row]:
    return _pool_rows(info, 3, linear=True)


# Dropout is pointwise but draws a random mask, so no P. Masks are drawn per rank: a sharded
# dropout is a valid dropout but not bitwise equal to eager's, and a replicated one needs the
# ranks' RNGs in step. Evaluation mode (train=False) is the identity and passes P.
@register(aten.dropout.default, aten.native_dropout.default)
def dropout_rule(info: OpInfo) -> list[Row]:
    rows = shard_rows(info)
    if (info.kw["train"] is False or info.kw["p"] == 0) and info.target is aten.dropout.default:
        rows.append(Row((P,), P))
    return rows
