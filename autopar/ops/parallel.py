"""Kernel implementations (see ``autopar.ops.kernels``).

Each kernel takes the aten op's arguments by schema name plus ``axis_groups``: the process-group names
of the mesh axes on which its row was chosen, outermost first. With ``axis_groups=()`` each computes
exactly its op. Values that are summed over ranks go through ``collectives.all_reduce`` (identity
backward); a value that is then used by every rank's *local* slice also goes through
``collectives.allreduce_grad``, because each rank's gradient for it is only a partial sum.

The process groups come as ``axis_groups`` so that they never clash with an op argument (conv2d
has an int argument called ``groups``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from autopar.errors import InternalError
from autopar.ops import collectives
from autopar.ops.kernels import EAGER_IMPLEMENTATIONS, register_kernel
from autopar.trace.functions import FUNCTION_OP, apply_function_eager
from autopar.trace.moe import EXPERTS_OP, combine, expert_mlp, moe_experts_eager

aten = torch.ops.aten


def split_count(groups: Sequence[str]) -> int:
    """How many ranks share the work: the product of the group sizes."""
    return math.prod(collectives.group_size(g) for g in groups)


def block_index(groups: Sequence[str]) -> int:
    """This rank's chunk index along a dim sharded on ``groups`` (outermost first, nested)."""
    index = 0
    for group in groups:
        index = index * collectives.group_size(group) + collectives.group_rank(group)
    return index


def _sum_over(x: torch.Tensor, groups: Sequence[str]) -> torch.Tensor:
    """Differentiable sum over the groups whose value every rank then uses locally: forward
    all-reduce; backward all-reduce of the ranks' partial gradients."""
    for group in groups:
        x = collectives.all_reduce(x, group)
    for group in groups:
        x = collectives.allreduce_grad(x, group)
    return x


class _ShareBias(torch.autograd.Function):
    """``bias / k`` in forward, identity in backward.

    The op's output is Partial, so its gradient is whole on every rank, and so is the bias
    gradient computed from it: each rank already holds the full bias gradient, and the rule
    marks the bias ``whole_grad`` so that no all-reduce is added. (Megatron adds the bias after
    the all-reduce for the same effect.)
    """

    @staticmethod
    def forward(ctx, bias, k):
        return bias / k

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _share_bias(bias: torch.Tensor, axis_groups: Sequence[str]) -> torch.Tensor:
    return _ShareBias.apply(bias, split_count(axis_groups))


@register_kernel("linear_bias_split")
def linear_bias_split(
    *, axis_groups: Sequence[str], input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, **_: Any
) -> torch.Tensor:
    """Row-parallel linear: each rank adds ``bias / k``, so the partial sums add up to the
    biased result."""
    return aten.linear(input, weight, _share_bias(bias, axis_groups))


@register_kernel("addmm_bias_split")
def addmm_bias_split(
    *,
    axis_groups: Sequence[str],
    self: torch.Tensor,
    mat1: torch.Tensor,
    mat2: torch.Tensor,
    beta: Any = 1,
    alpha: Any = 1,
    **_: Any,
) -> torch.Tensor:
    """Contraction-split addmm: each rank adds ``beta * self / k``."""
    return aten.addmm(_share_bias(self, axis_groups), mat1, mat2, beta=beta, alpha=alpha)


@register_kernel("conv2d_bias_split")
def conv2d_bias_split(
    *,
    axis_groups: Sequence[str],
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    stride: Any = (1, 1),
    padding: Any = (0, 0),
    dilation: Any = (1, 1),
    **_: Any,
) -> torch.Tensor:
    """Input-channel-split conv2d (conv groups == 1): each rank adds ``bias / k``."""
    return aten.conv2d(input, weight, _share_bias(bias, axis_groups), stride, padding, dilation, 1)


@register_kernel("mean_partial")
def mean_partial(
    *,
    axis_groups: Sequence[str],
    self: torch.Tensor,
    dim: Any = None,
    keepdim: bool = False,
    dtype: torch.dtype | None = None,
    **_: Any,
) -> torch.Tensor:
    """The mean over a sharded dim as a Partial: the local sum over the *global* count. Shards
    are even, so that is the local mean divided by the number of ranks."""
    if dim is None and not keepdim:
        local = aten.mean.default(self, dtype=dtype)
    else:
        local = aten.mean.dim(self, dim, keepdim, dtype=dtype)
    return local / split_count(axis_groups)


@register_kernel("embedding_vocab_split")
def embedding_vocab_split(
    *, axis_groups: Sequence[str], weight: torch.Tensor, indices: torch.Tensor, padding_idx: int = -1, **_: Any
) -> torch.Tensor:
    """Vocab-parallel embedding: this rank holds rows [start, start + rows) of the table, looks
    up the indices that fall there and writes zeros for the rest (a Partial result)."""
    rows = weight.shape[0]
    start = block_index(axis_groups) * rows
    local = indices - start
    outside = (local < 0) | (local >= rows)
    local_padding = -1  # the padding row only changes the gradient, on the rank that holds it
    if padding_idx is not None and padding_idx >= 0 and 0 <= padding_idx - start < rows:
        local_padding = padding_idx - start
    out = aten.embedding(weight, local.masked_fill(outside, 0), local_padding)
    return out.masked_fill(outside.unsqueeze(-1), 0)


@register_kernel("cross_entropy_mean")
def cross_entropy_mean(
    *,
    axis_groups: Sequence[str],
    self: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    **_: Any,
) -> torch.Tensor:
    """Batch-split mean cross entropy, whole on every rank after ONE all-reduce per axis of two
    numbers: the rank's loss sum and its denominator (non-ignored targets, their total class
    weight, or for probability targets the number of samples), summed in float64. The gradient
    of the local sum is one over the global denominator, so backward communicates nothing. A
    Partial result would need two: the global denominator before the division, then the sum of
    the partial losses (the latency a data-parallel forward pays that DDP's does not)."""
    if target.is_floating_point():
        denominator = torch.tensor(self.numel() // self.shape[1], dtype=torch.float64, device=self.device)
    else:
        valid = target != ignore_index
        if weight is None:
            denominator = valid.sum(dtype=torch.float64)  # exact below 2**53 targets; no cast after
        else:
            picked = weight.detach()[target.masked_fill(~valid, 0)]
            denominator = picked.masked_fill(~valid, 0).sum()
    local_sum = aten.cross_entropy_loss(self, target, weight, 2, ignore_index, label_smoothing)
    stats = torch.stack([local_sum.detach().to(torch.float64), denominator.detach().to(torch.float64)])
    for group in axis_groups:
        stats = collectives.no_grad_all_reduce(stats, group)
    total, count = stats.unbind()
    return _WholeMean.apply(local_sum, total, count)


class _WholeMean(torch.autograd.Function):
    """The batch-split loss whole: value the global sum over the global denominator (float64,
    then the loss's dtype through at least float32); gradient one over the denominator to the
    local sum, in at least float32. One autograd node, where the same arithmetic written with
    ``x - x.detach()`` took three (sub, div, add) and as many ops more in forward."""

    @staticmethod
    def forward(ctx, local_sum: torch.Tensor, total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        wide = torch.promote_types(local_sum.dtype, torch.float32)  # the scale 1/count in at least float32
        ctx.count = count.to(wide)
        return (total / count).to(wide).to(local_sum.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return (grad.to(ctx.count.dtype) / ctx.count).to(grad.dtype), None, None


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross entropy of logits whose class dim is split over ``axis_groups`` (Megatron's
    vocab-parallel loss), with ONE collective per axis. Forward: each rank's softmax of its own
    classes (torch's fused kernel), their log-sum-exp and the target logit (0 on the ranks whose
    classes do not hold the target) go as [2, N] into one all-gather, and every rank combines
    them the same way (log-sum-exp and sum over the ranks, in rank order), so the [N, C] logits
    are never gathered; rescaled by exp(local - global log-sum-exp), the local softmax is this
    rank's slice of the whole one. Megatron all-reduces the max, the target logit and the sum
    of exponentials one after another: three latencies where this pays one. The loss is whole
    on every rank, so each rank's gradient is its own slice of softmax - one-hot: no
    communication in backward."""

    @staticmethod
    def forward(ctx, logits, target, axis_groups, ignore_index, reduction):
        rows = logits.shape[1]
        start = block_index(axis_groups) * rows
        # At least float32 (half-precision logits are upcast, as F.cross_entropy's kernels do);
        # float64 stays float64.
        x = logits.detach().to(torch.promote_types(logits.dtype, torch.float32))
        softmax, local_lse = _local_softmax(x)
        valid = target != ignore_index
        local = target - start
        inside = valid & (local >= 0) & (local < rows)
        local = local.clamp(0, rows - 1)
        picked = x.gather(1, local[:, None]).squeeze(1).masked_fill(~inside, 0)
        lse = local_lse
        for group in axis_groups:
            gathered = collectives.no_grad_all_gather(torch.stack([lse, picked]), 0, group).view(-1, 2, lse.shape[0])
            lse, picked = torch.logsumexp(gathered[:, 0], 0), gathered[:, 1].sum(0)
        softmax.mul_((local_lse - lse).exp_()[:, None])
        per_sample = (lse - picked) * valid
        count = valid.sum()
        ctx.save_for_backward(softmax, local, inside, valid, count)
        ctx.reduction, ctx.dtype = reduction, logits.dtype
        if reduction == 0:
            return per_sample.to(logits.dtype)
        total = per_sample.sum()
        return (total / count if reduction == 1 else total).to(logits.dtype)

    @staticmethod
    def backward(ctx, grad):
        collectives.refuse_double_backward(grad, saves_inputs=True)  # its softmax is saved detached
        softmax, local, inside, valid, count = ctx.saved_tensors
        # (softmax - one-hot) * scale per row: one pass over the [N, C] slice
        scale = grad.to(softmax.dtype) * valid
        if ctx.reduction == 1:
            scale = scale / count
        out = softmax * scale[:, None]
        out[torch.arange(out.shape[0], device=out.device), local] -= inside * scale
        return out.to(ctx.dtype), None, None, None, None


def _local_softmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax of each row of ``x``, its log-sum-exp). The log-sum-exp is read off the softmax
    at the row's max (1 / the sum of exponentials there, which is at least 1 / C: no loss of
    precision). A row whose classes are all masked (-inf) has softmax 0 and log-sum-exp -inf."""
    peak = x.amax(1)
    softmax = torch.softmax(x, 1)
    empty = peak == -math.inf
    # A pass over [N, C] on the CPU only where a row needs it; on a device (or traced) the pass
    # is cheaper than the host sync (or the graph break) that reading ``any()`` would be.
    if x.device.type != "cpu" or torch.compiler.is_compiling() or bool(empty.any()):
        softmax.masked_fill_(empty[:, None], 0.0)
    return softmax, (peak - softmax.amax(1).log()).masked_fill(empty, -math.inf)


@register_kernel("cross_entropy_vocab_split")
def cross_entropy_vocab_split(
    *,
    axis_groups: Sequence[str],
    self: torch.Tensor,
    target: torch.Tensor,
    reduction: int = 1,
    ignore_index: int = -100,
    **_: Any,
) -> torch.Tensor:
    """Vocab-parallel cross entropy: logits [N, C] split along C, class-index targets whole; the
    result (whole on every rank) equals ``cross_entropy(logits, target)`` without a weight or
    label smoothing."""
    return _VocabParallelCrossEntropy.apply(self, target, tuple(axis_groups), ignore_index, reduction)


@register_kernel("sync_batch_norm")
def sync_batch_norm(*, axis_groups: Sequence[str], input: torch.Tensor, training: bool, **batch_norm: Any) -> torch.Tensor:
    """Training-mode batch norm with the batch (or spatial) dims sharded on ``axis_groups``: the
    per-channel mean and biased variance are all-reduced, and the running statistics are
    updated in place with the global ones (unbiased variance), as eager does. ``batch_norm``
    holds the rest of ``aten.batch_norm``'s arguments by name: ``weight``, ``bias``,
    ``running_mean``, ``running_var`` (each a tensor or None), ``momentum``, ``eps`` and
    ``cudnn_enabled``."""
    weight, bias = batch_norm["weight"], batch_norm["bias"]
    running_mean, running_var = batch_norm["running_mean"], batch_norm["running_var"]
    momentum, eps = batch_norm["momentum"], batch_norm["eps"]
    if not training:
        return aten.batch_norm(
            input, weight, bias, running_mean, running_var, training, momentum, eps, batch_norm.get("cudnn_enabled", True)
        )
    dims = [0] + list(range(2, input.ndim))
    count = input.numel() // input.shape[1] * split_count(axis_groups)
    mean = _sum_over(input.sum(dims), axis_groups) / count
    shape = [1, -1] + [1] * (input.ndim - 2)
    centered = input - mean.reshape(shape)
    var = _sum_over((centered * centered).sum(dims), axis_groups) / count
    out = centered * torch.rsqrt(var + eps).reshape(shape)
    if weight is not None:
        out = out * weight.reshape(shape)
    if bias is not None:
        out = out + bias.reshape(shape)
    with torch.no_grad():
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(mean.detach().to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            unbiased = var.detach() * (count / max(count - 1, 1))
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
    return out


# ---------------------------------------------------------------------------------------------
# Mixture of experts (rules.moe): experts split along their expert dim over ``axis_groups``.


EAGER_IMPLEMENTATIONS[EXPERTS_OP] = moe_experts_eager
EAGER_IMPLEMENTATIONS[FUNCTION_OP] = apply_function_eager  # the user's Function, its backward without recompute


def _local_experts(gate_up: torch.Tensor, axis_groups: Sequence[str]) -> tuple[int, int]:
    """(first global expert held here, number held): experts are split in equal blocks."""
    num_local = gate_up.shape[0]
    return block_index(axis_groups) * num_local, num_local


@register_kernel("moe_experts_local")
def moe_experts_local(
    *,
    axis_groups: Sequence[str],
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    transposed: bool = False,
    **_: Any,
) -> torch.Tensor:
    """Expert parallelism over replicated tokens: every rank sees every token, runs only the
    token copies routed to the experts it holds, and leaves zeros for the others, so the sum
    over ranks is the layer's output (a Partial result). Each rank's gradients of the tokens and
    routing weights are partial sums too (the plan all-reduces them); its expert gradients are
    whole."""
    first, num_local = _local_experts(gate_up, axis_groups)
    top_k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    mine = ((flat >= first) & (flat < first + num_local)).nonzero().squeeze(1)
    x = hidden.to(gate_up.dtype)[mine // top_k]
    y = expert_mlp(x, flat[mine] - first, gate_up, down, transposed)
    slot_out = y.new_zeros(flat.shape[0], y.shape[1]).index_put((mine,), y)
    return combine(slot_out, top_k_weights, hidden.dtype)


@register_kernel("moe_experts_all_to_all")
def moe_experts_all_to_all(
    *,
    axis_groups: Sequence[str],
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    transposed: bool = False,
    **_: Any,
) -> torch.Tensor:
    """Expert parallelism with all-to-all dispatch and combine, on one mesh axis: tokens and
    experts are both split on it. Each token copy (a token and one of its top-k experts) goes to
    the rank holding its expert; that rank runs its local experts on what it received and sends
    the results back, where they are weighted and summed as the layer does.

    1. sort this rank's token copies by expert (so by destination rank), count them per rank;
    2. exchange the counts (all-to-all of one integer per rank), then the rows and their local
       expert ids (all-to-all with those uneven splits);
    3. run the local experts; send the results back (the reverse all-to-all);
    4. put them back in token order, weight and sum the top-k copies of each token.

    Autograd runs the reverse exchanges in backward, so each rank's expert gradients sum over
    every token routed to its experts, from every rank."""
    if not axis_groups:
        return moe_experts_eager(hidden, top_k_index, top_k_weights, gate_up, down, transposed)
    if len(axis_groups) != 1:
        raise InternalError(f"moe_experts_all_to_all runs over one mesh axis, got groups {list(axis_groups)}")
    group = axis_groups[0]
    num_ranks = collectives.group_size(group)
    num_local = gate_up.shape[0]
    top_k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    send_counts = torch.bincount(expert // num_local, minlength=num_ranks)
    recv_counts = collectives.no_grad_all_to_all_rows(send_counts, [1] * num_ranks, [1] * num_ranks, group)
    send, recv = send_counts.tolist(), recv_counts.tolist()
    x = hidden.to(gate_up.dtype)[order // top_k]
    received = collectives.all_to_all_rows(x, recv, send, group)
    local_ids = collectives.no_grad_all_to_all_rows(expert % num_local, recv, send, group)
    y = expert_mlp(received, local_ids, gate_up, down, transposed)
    returned = collectives.all_to_all_rows(y, send, recv, group)
    return combine(returned[torch.argsort(order)], top_k_weights, hidden.dtype)


@register_kernel("grouped_mm_local_experts")
def grouped_mm_local_experts(
    *, axis_groups: Sequence[str], input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, **_: Any
) -> torch.Tensor:
    """Hugging Face's grouped expert matmul with the weight split by expert: rows are sorted by
    expert and ``offs`` holds each expert's end row. This rank multiplies the row groups of the
    experts it holds and writes zeros elsewhere (a Partial result)."""
    first, num_local = _local_experts(weight, axis_groups)
    ends = offs.tolist()
    start = ends[first - 1] if first > 0 else 0
    pieces = [input.new_zeros(start, weight.shape[2])]
    for expert in range(num_local):
        end = ends[first + expert]
        pieces.append(input[start:end] @ weight[expert])
        start = end
    pieces.append(input.new_zeros(input.shape[0] - start, weight.shape[2]))
    return torch.cat(pieces)
