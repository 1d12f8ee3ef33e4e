"""Colossal-AI's 2D, 2.5D and 3D layouts as autopar plans: bytes per transformer block against the papers.

Pre-LayerNorm GPT blocks (width h, fused qkv, 4h MLP, batch b, sequence s, fp32) are planned
with ``autopar.hand_plan("colossal", ...)`` on (2, 2) for 2D, (2, 2, 2) for 3D and 2.5D of
depth 2, and with ``autopar.plan`` on the same mesh. The bytes each device sends per step for
one block (forward and backward, as priced: ``plan.predicted.comm_bytes``, which prices the
collectives the rewrite inserts; two blocks less one, so the model's whole input and its loss
drop out) are set beside the volumes of the papers' algorithms for the block's four matmuls
(K × M: qkv h × 3h, attention output h × h, MLP h × 4h and 4h × h; N = b · s tokens; q the grid
side; d the depth; 4 bytes an element):

- 2D, SUMMA / Optimus (Xu et al. 2021): forward broadcasts A's and B's blocks along rows and
  columns, backward does it twice more (dA = dC Bᵀ, dB = Aᵀ dC): 3 (q−1)/q² (NK + KM).
- 2.5D, Tesseract (Wang et al. 2021): SUMMA on each of d layers with A's rows split d ways, and
  the weight gradient all-reduced over depth: 3 (q−1)/q² (NK/d + KM) + 2 (d−1)/d · KM/q².
- 3D (Bian et al. 2021, Colossal-AI's Linear3D): all-gather of X and W, reduce-scatter of Y, and
  their duals in backward: 2 (q−1)/q² (NK + KM + NM).

    python benchmarks/bench_colossal.py            # h=1024, s=512, b=8 (about a minute)
    python benchmarks/bench_colossal.py --seed     # also: the seed's pipeline=2, 2.5d config on GPT vs the solver
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn

import autopar
from autopar.zoo.models import GPTBlock, build_model, example_batch

BYTES = 4  # fp32


class Blocks(nn.Module):
    """``num`` GPT blocks with Colossal-AI's fused qkv projection, and a loss."""

    def __init__(self, num: int, width: int, heads: int) -> None:
        super().__init__()
        self.h = nn.ModuleList(GPTBlock(width, heads, fused_qkv=True) for _ in range(num))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.h:
            x = block(x)
        return x.square().mean()


def per_block(plan_of) -> tuple[float, list[float], dict]:
    """Bytes of one block: a model of two blocks less a model of one, so that neither the whole
    input (cut locally, for free) nor the loss counts; also the two-block plans themselves."""
    two, one = plan_of(2), plan_of(1)
    total = two.predicted.comm_bytes - one.predicted.comm_bytes
    axes = [a - b for a, b in zip(two.predicted.comm_bytes_per_axis, one.predicted.comm_bytes_per_axis)]
    return total, axes, two


def matmuls(width: int) -> list[tuple[int, int]]:
    return [(width, 3 * width), (width, width), (width, 4 * width), (4 * width, width)]


def paper_bytes(mode: str, tokens: int, width: int, q: int, depth: int = 1) -> float:
    total = 0.0
    for k, m in matmuls(width):
        if mode == "2d":
            total += 3 * (q - 1) / q**2 * (tokens * k + k * m)
        elif mode == "2.5d":
            total += 3 * (q - 1) / q**2 * (tokens * k / depth + k * m) + 2 * (depth - 1) / depth * k * m / q**2
        else:
            total += 2 * (q - 1) / q**2 * (tokens * k + k * m + tokens * m)
    return total * BYTES


# (label, parallel, q, depth, comm): None is CommOptions() (FSDP2's reshard_after_forward).
CASES = (
    ("2d", dict(tensor=dict(mode="2d", size=4)), 2, 1, None),
    ("2.5d", dict(tensor=dict(mode="2.5d", size=8, depth=2)), 2, 2, None),
    ("3d", dict(tensor=dict(mode="3d", size=8)), 2, 1, None),
)


def block_table(width: int, heads: int, seq: int, batch: int) -> list[dict]:
    with torch.device("meta"):
        models = {n: Blocks(n, width, heads) for n in (1, 2)}
        x = torch.randn(batch, seq, width)
    rows = []
    for label, parallel, q, depth, comm in CASES:
        start = time.perf_counter()
        mode = parallel["tensor"]["mode"]
        hand, hand_axes, hand_two = per_block(
            lambda n: autopar.hand_plan(
                "colossal", models[n], example_inputs=(x,), parallel=parallel, memory_budget=float("inf"), comm=comm
            )
        )
        solved, _, solved_two = per_block(
            lambda n: autopar.plan(models[n], hand_two.mesh_shape, example_inputs=(x,), memory_budget=float("inf"), comm=comm)
        )
        rows.append(
            dict(
                mode=label,
                mesh=hand_two.mesh_shape,
                autopar=hand,
                per_axis=hand_axes,
                paper=paper_bytes(mode, batch * seq, width, q, depth),
                solver_bytes=solved,
                step=hand_two.predicted.step_time_s,
                solver_step=solved_two.predicted.step_time_s,
                seconds=time.perf_counter() - start,
            )
        )
    return rows


def seed_comparison() -> dict:
    """The seed's example on the zoo GPT (batch 16, two layers), against the solver's pipeline on the same mesh."""
    model = build_model("gpt", seed=0, n_layer=2, n_embd=256, n_head=8, vocab_size=512, block_size=128)
    batch = example_batch("gpt", 16, seed=1, vocab_size=512, block_size=128)
    parallel = dict(pipeline=2, tensor=dict(mode="2.5d", depth=1, size=4))
    hand = autopar.hand_plan("colossal", model, example_inputs=batch, parallel=parallel)
    solved = autopar.plan(model, hand.mesh_shape, example_inputs=batch, pipeline=2, num_microbatches=2)
    from autopar.report.versus import versus_text

    return {"mesh": hand.mesh_shape, "text": versus_text(hand, solved, "Colossal-AI's layout")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seed", action="store_true", help="also compare the seed's config with the solver's plan")
    args = parser.parse_args()
    print(
        f"one GPT block (two blocks less one): h={args.width}, heads={args.heads}, s={args.seq}, b={args.batch}, fp32 "
        f"(MiB each device sends per step)"
    )
    print(
        "| mode | mesh | autopar (Colossal layout) | paper | autopar / paper | solver's own plan | "
        "step (2 blocks): Colossal / solver |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for row in block_table(args.width, args.heads, args.seq, args.batch):
        print(
            f"| {row['mode']} | {tuple(row['mesh'])} | {row['autopar'] / 2**20:.2f} | {row['paper'] / 2**20:.2f} | "
            f"{row['autopar'] / row['paper']:.3f} | {row['solver_bytes'] / 2**20:.2f} | "
            f"{row['step'] / row['solver_step']:.2f} |"
        )
        print(
            f"<!-- {row['mode']}: per axis {[round(b / 2**20, 2) for b in row['per_axis']]} MiB, "
            f"planned in {row['seconds']:.1f} s -->"
        )
    if args.seed:
        seed = seed_comparison()
        print(f"\nseed config, pipeline=2 × 2.5d depth 1 size 4 on mesh {tuple(seed['mesh'])}:\n{seed['text']}")


if __name__ == "__main__":
    main()
