"""Sharding rules for mixture-of-experts ops: the whole experts layer (``autopar::moe_experts``,
see ``trace.moe``) and Hugging Face's grouped expert matmul (``transformers::grouped_mm_fallback``).

``moe_experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k], gate_up [E, ., .],
down [E, ., .])`` is independent across tokens, so on one mesh axis it offers:

- tokens split, every expert whole on every rank: data parallelism (no kernel);
- **expert parallelism**: tokens *and* experts split on the axis. Each rank holds E/n experts;
  the kernel ``moe_experts_all_to_all`` sends each of its token copies to the rank that holds
  its expert, runs the local experts, and sends the results back (two all-to-alls with
  data-dependent splits, whose counts are exchanged first);
- **expert parallelism over replicated tokens**: experts split, tokens whole. The kernel
  ``moe_experts_local`` runs only the local experts on the tokens routed to them and leaves
  zeros for the rest, so the result is Partial (summed by the all-reduce the plan then needs).

Expert parallelism splits the experts' work among the ranks unevenly (routing is data-
dependent); ``cost.compute`` prices the busiest rank with a capacity factor.

``grouped_mm_fallback(input [S, K], weight [E, K, N], offs [E])`` multiplies the rows of each
expert's group (rows ``offs[e-1]:offs[e]``, sorted by expert) by that expert's matrix. With the
weight split by expert and rows and offsets whole, the kernel ``grouped_mm_local_experts`` runs
the local experts' groups and writes zeros elsewhere: a Partial result.
"""

from __future__ import annotations

from autopar.ir.spec import P, R, S
from autopar.ir.summary import EXPERT_PARALLEL_TEXT
from autopar.rules.registry import SINGLE_AXIS_KERNELS, OpInfo, Row, register, replicate_row
from autopar.trace.moe import EXPERTS_OP

# The all-to-all kernel moves tokens over one mesh axis: an exchange over two axes at once is
# not built, so ``registry.expand_rows`` keeps only strategies that run it on a single axis.
SINGLE_AXIS_KERNELS.add("moe_experts_all_to_all")

# Kernels that split experts by rank (plan summaries name them: ``ir.summary.EXPERT_PARALLEL_TEXT``).
EXPERT_PARALLEL_KERNELS = frozenset(EXPERT_PARALLEL_TEXT)


@register(EXPERTS_OP)
def moe_experts_rule(info: OpInfo) -> list[Row]:
    # inputs: hidden, top_k_index, top_k_weights, gate_up, down
    rows = [replicate_row(info)]
    rows.append(Row((S(0), S(0), S(0), R, R), S(0)))
    rows.append(Row((S(0), S(0), S(0), S(0), S(0)), S(0), kernel="moe_experts_all_to_all"))
    rows.append(Row((R, R, R, S(0), S(0)), P, kernel="moe_experts_local"))
    return rows


@register("transformers::grouped_mm_fallback")
def grouped_mm_rule(info: OpInfo) -> list[Row]:
    # inputs: input [S, K], weight [E, K, N], offs [E]
    if len(info.inputs) != 3 or info.inputs[1].ndim != 3:
        return [replicate_row(info)]
    return [replicate_row(info), Row((R, S(0), R), P, kernel="grouped_mm_local_experts")]


__all__ = ["moe_experts_rule", "grouped_mm_rule", "EXPERT_PARALLEL_KERNELS"]
