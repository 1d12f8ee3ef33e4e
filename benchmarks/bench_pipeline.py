"""Measured step time of pipelined plans on gloo: where the parameters' collectives run.

    python benchmarks/bench_pipeline.py                      # M = 8 and 16, 4 ranks: results/pipeline.csv
    python benchmarks/bench_pipeline.py --microbatches 32 --steps 3

A GPT (``autopar.zoo.models``, 4 layers, 256 wide, 16 sequences of 128 tokens, fp32) trained with
AdamW on mesh (2, 2): two pipeline stages (1F1B, M microbatches), each on a stage mesh (1, 2).
Three layouts of the same stages, each compiled with ``autopar.compile(..., plan=...)`` and run
for ``--steps`` steps after two warm-up steps (median):

* ``ddp``: the planner's plan for this host (``SPEC``, as ``compile`` prices it), every
  parameter replicated in the stage (its gradient all-reduced once a step: ``passes.held``);
* ``fsdp``: every layer's matrix sharded on the stage mesh's second axis, gathered (and its
  gradient reduce-scattered) in each microbatch;
* ``fsdp_held``: the same, its gathered parameters held through the step
  (``StagePlan.hold_gathered``): gathered and reduce-scattered once.

``held_over_fsdp`` is the held layout's step over the per-microbatch one. Every layout's last loss
is printed: they agree to the last digits (the same numbers, summed in another order).

``--accuracy`` measures the planner's predictions instead: the same GPT planned as ``compile``
prices it on this host (``cpu_cluster`` with one thread a rank), without a pipeline (M = 0) and
with two stages at each ``--microbatches``, each plan's predicted step against its measured one
(``results/pipeline_accuracy.csv``).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import time

import torch

import autopar
from autopar.cost.cluster import cpu_cluster
from autopar.runtime.tools.launch import run_distributed
from autopar.zoo.models import build_model, example_batch

CONFIG = dict(n_layer=4, n_embd=256, n_head=4, bias=False)
BATCH, MESH, STAGES = 16, (2, 2), 2
SPEC = cpu_cluster(threads_per_rank=1)  # what compile prices in a rank of one thread on this host


def fsdp_in_stages(text: str, hold: bool) -> str:
    """The pipelined plan ``text`` (JSON, every parameter replicated) with each layer's matrix
    (``.h.`` in its name, two dims) sharded on dim 0 over the stage mesh's second axis, and its
    gathered parameters held through the step where ``hold``."""
    data = json.loads(text)
    data["pipeline"].pop("hold_gathered", None)
    if hold:
        data["pipeline"]["hold_gathered"] = True
    placeholders = {n.replace(".", "_"): n for n in data["params"]}
    for name, node in data["nodes"].items():
        fqn = placeholders.get(name.removeprefix("p_"))
        if node["op"] == "param" and fqn is not None and ".h." in fqn and len(node["shape"][0]) == 2:
            node["out"] = [["R", "S(0)"]]
            data["params"][fqn] = ["R", "S(0)"]
    return json.dumps(data)


def _steps(rank: int, world: int, texts: dict[str, str], steps: int) -> dict[str, tuple[float, float]]:
    out = {}
    for label, text in texts.items():
        model = build_model("gpt", seed=0, **CONFIG)
        batch = example_batch("gpt", BATCH, seed=1)
        pm = autopar.compile(model, MESH, example_inputs=batch, plan=autopar.Plan.from_json(text))
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
        times = []
        for _ in range(steps + 2):
            start = time.perf_counter()
            loss = pm(*batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - start)
        out[label] = (statistics.median(times[2:]), loss.item())
    return out


def run(microbatches: int, steps: int) -> dict:
    model = build_model("gpt", seed=0, **CONFIG)
    batch = example_batch("gpt", BATCH, seed=1)
    plan = autopar.plan(model, MESH, example_inputs=batch, cluster=SPEC, pipeline=STAGES, num_microbatches=microbatches)
    if not all(p.is_replicate() for spec in plan.params.values() for p in spec):
        raise SystemExit(
            f"at {microbatches} microbatches this host's plan shards a parameter, but the ddp layout needs "
            "every one replicated: use other --microbatches"
        )
    texts = {
        "ddp": plan.to_json(),
        "fsdp": fsdp_in_stages(plan.to_json(), hold=False),
        "fsdp_held": fsdp_in_stages(plan.to_json(), hold=True),
    }
    ranks = run_distributed(_steps, 4, texts, steps, timeout_s=900)
    # a step ends when its slowest rank does
    step = {label: max(r[label][0] for r in ranks) for label in texts}
    return {
        "microbatches": microbatches,
        **{f"{label}_s": round(seconds, 4) for label, seconds in step.items()},
        "held_over_fsdp": round(step["fsdp_held"] / step["fsdp"], 3),
        **{f"{label}_loss": ranks[0][label][1] for label in texts},
    }


def accuracy(microbatches: list[int], steps: int) -> list[dict]:
    """Each plan's predicted step on this host's spec against its measured one (module docstring)."""
    texts, predicted = {}, {}
    for m in [0, *microbatches]:
        model = build_model("gpt", seed=0, **CONFIG)
        pipeline = dict(pipeline=STAGES, num_microbatches=m) if m else {}
        plan = autopar.plan(model, MESH, example_inputs=example_batch("gpt", BATCH, seed=1), cluster=SPEC, **pipeline)
        texts[m], predicted[m] = plan.to_json(), plan.predicted.step_time_s
    ranks = run_distributed(_steps, 4, texts, steps, timeout_s=900)
    rows = []
    for m in texts:
        measured = max(r[m][0] for r in ranks)
        rows.append(
            {
                "microbatches": m,
                "predicted_s": round(predicted[m], 4),
                "measured_s": round(measured, 4),
                "measured_over_predicted": round(measured / predicted[m], 2),
            }
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, nargs="*", default=[8, 16])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--accuracy", action="store_true", help="predicted against measured steps (module docstring)")
    parser.add_argument("--out", default=None, help="CSV to write (default results/pipeline.csv or pipeline_accuracy.csv)")
    args = parser.parse_args()
    name = "pipeline_accuracy.csv" if args.accuracy else "pipeline.csv"
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", name)
    if args.accuracy:
        rows = accuracy(args.microbatches, args.steps)
    else:
        rows = [run(microbatches, args.steps) for microbatches in args.microbatches]
    for row in rows:
        print(row, flush=True)
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
