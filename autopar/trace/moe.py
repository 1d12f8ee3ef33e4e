"""Mixture-of-experts layers traced as one op, so that expert parallelism is one decision.

A *stacked experts module* holds every expert's weights in two parameters with a leading
expert dim, and is called with the router's choice. Hugging Face's experts classes (Mixtral,
Qwen-MoE, DeepSeek, OLMoE: ``use_experts_implementation``) and ``autopar.zoo.models.Experts``
follow this convention::

    gate_up_proj  [E, 2·I, H]   (transposed: [E, H, 2·I])   gate rows first, then up rows
    down_proj     [E, H, I]     (transposed: [E, I, H])
    forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]

    out[t] = Σ_j top_k_weights[t, j] · down_e(silu(gate_e(x_t)) · up_e(x_t)),  e = top_k_index[t, j]

Traced as it is, such a module becomes data-dependent indexing (sort, histc, gathers) around
grouped matmuls, none of which can be split by expert on its own. While tracing, ``trace``
swaps the forward of each module that matches the convention exactly (``experts_call``) for one
call of the custom op ``autopar::moe_experts``, whose sharding rule (``rules.moe``) offers
the experts split along their expert dim, with tokens exchanged by all-to-all. A module that
differs in any way the op does not compute (a bias, another activation or gate, a post-expert
norm, interleaved gate/up rows) is traced as it is.

The op's autograd recomputes its forward in backward (``_backward``): it is what the whole
traced graph runs when it is executed as it is (the numerics guard's reference). Parallel
modules run ``moe_experts_eager`` or a kernel of ``ops.parallel`` instead, which autograd
differentiates without recomputing.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch
import torch.nn.functional as F

_EXPECTED_ARGS = ("hidden_states", "top_k_index", "top_k_weights")


def expert_mlp(
    x: torch.Tensor, expert_ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, transposed: bool
) -> torch.Tensor:
    """Row ``i`` of the result is expert ``expert_ids[i]``'s gated MLP of ``x[i]``, for experts
    ``0 .. gate_up.shape[0] - 1`` (the weights given). Differentiable in ``x`` and the weights;
    every expert's weights take part (an expert with no rows gets a zero gradient, so every
    rank's parameters have a gradient)."""
    num_experts = gate_up.shape[0]
    order = torch.argsort(expert_ids, stable=True)
    counts = torch.bincount(expert_ids, minlength=num_experts).tolist()
    pieces = torch.split(x[order], counts)
    outs = []
    for expert, piece in enumerate(pieces):
        w_in = gate_up[expert] if transposed else gate_up[expert].t()
        w_out = down[expert] if transposed else down[expert].t()
        gate, up = (piece @ w_in).chunk(2, dim=-1)
        outs.append((F.silu(gate) * up) @ w_out)
    y = torch.cat(outs) if outs else x.new_zeros(0, down.shape[2] if transposed else down.shape[1])
    return y[torch.argsort(order)]


def combine(slot_out: torch.Tensor, top_k_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Weight each token's ``k`` expert outputs (rows in token-major slot order) and sum them in
    slot order, as Hugging Face does (``view(T, k, H).sum(1)``)."""
    num_tokens, top_k = top_k_weights.shape
    weighted = slot_out * top_k_weights.reshape(-1, 1).to(slot_out.dtype)
    return weighted.view(num_tokens, top_k, -1).sum(dim=1).to(dtype)


def moe_experts_eager(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    transposed: bool = False,
) -> torch.Tensor:
    """What ``autopar::moe_experts`` computes, in differentiable torch ops."""
    top_k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    x = hidden.to(gate_up.dtype).repeat_interleave(top_k, dim=0)
    return combine(expert_mlp(x, flat, gate_up, down, transposed), top_k_weights, hidden.dtype)


@torch.library.custom_op("autopar::moe_experts", mutates_args=())
def _moe_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    transposed: bool,
) -> torch.Tensor:
    return moe_experts_eager(hidden, top_k_index, top_k_weights, gate_up, down, transposed)


@_moe_experts.register_fake
def _(hidden, top_k_index, top_k_weights, gate_up, down, transposed):
    return torch.empty_like(hidden)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[:5])
    ctx.transposed = inputs[5]


def _backward(ctx, grad):
    hidden, top_k_index, top_k_weights, gate_up, down = ctx.saved_tensors
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in (hidden, top_k_weights, gate_up, down)]
    with torch.enable_grad():
        out = moe_experts_eager(leaves[0], top_k_index, leaves[1], leaves[2], leaves[3], ctx.transposed)
        grads = torch.autograd.grad(out, leaves, grad, allow_unused=True)
    grads = [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, leaves)]
    return grads[0], None, grads[1], grads[2], grads[3], None


_moe_experts.register_autograd(_backward, setup_context=_setup_context)

EXPERTS_OP = torch.ops.autopar.moe_experts.default


def is_stacked_experts(module: torch.nn.Module) -> bool:
    """Whether ``module`` follows the stacked-experts convention (module docstring) exactly."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gate_up, torch.nn.Parameter) and isinstance(down, torch.nn.Parameter)):
        return False
    if gate_up.ndim != 3 or down.ndim != 3 or gate_up.shape[0] != down.shape[0]:
        return False
    if (
        getattr(module, "has_bias", False)
        or getattr(module, "has_post_expert_norm", False)
        or not getattr(module, "has_gate", True)
        or not getattr(module, "is_concatenated", True)
        or getattr(module, "_is_expert_parallel", False)
    ):
        return False
    act = getattr(module, "act_fn", None)
    if type(act).__name__ not in ("SiLU", "SiLUActivation") or getattr(act, "inplace", False):
        return False
    apply_gate = getattr(type(module), "_apply_gate", None)
    if apply_gate is not None and apply_gate.__name__ != "_default_apply_gate":
        return False
    try:
        names = tuple(inspect.signature(module.forward).parameters)[:3]
    except (TypeError, ValueError):
        return False
    if names != _EXPECTED_ARGS:
        return False
    transposed = bool(getattr(module, "is_transposed", False))
    hidden = gate_up.shape[1] if transposed else gate_up.shape[2]
    two_inter = gate_up.shape[2] if transposed else gate_up.shape[1]
    down_in, down_out = (down.shape[1], down.shape[2]) if transposed else (down.shape[2], down.shape[1])
    return two_inter % 2 == 0 and down_in == two_inter // 2 and down_out == hidden


def experts_call(module: torch.nn.Module):
    """The forward that ``experts_as_one_op`` gives a stacked experts module."""
    transposed = bool(getattr(module, "is_transposed", False))

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return _moe_experts(hidden_states, top_k_index, top_k_weights, module.gate_up_proj, module.down_proj, transposed)

    return forward


@contextlib.contextmanager
def experts_as_one_op(model: torch.nn.Module) -> Iterator[list[str]]:
    """Inside the block, every stacked experts module of ``model`` calls ``autopar::moe_experts``;
    yields their names. Their own forwards come back on exit."""
    patched = [(name, m) for name, m in model.named_modules() if is_stacked_experts(m)]
    saved = [(m, m.__dict__.get("forward")) for _, m in patched]
    try:
        for _, module in patched:
            module.forward = experts_call(module)
        yield [name for name, _ in patched]
    finally:
        for module, own in saved:
            if own is None:
                del module.forward
            else:
                module.forward = own


__all__ = ["EXPERTS_OP", "combine", "expert_mlp", "experts_as_one_op", "experts_call", "is_stacked_experts", "moe_experts_eager"]
