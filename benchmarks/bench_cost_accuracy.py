"""Cost-model accuracy: predicted against measured step time, per-rank peak memory and bytes sent.

    python benchmarks/bench_cost_accuracy.py --out benchmarks/results/cost_accuracy.csv
    python benchmarks/bench_cost_accuracy.py --profile   # plan with a spec measured by autopar profile
    python benchmarks/bench_cost_accuracy.py --reprice benchmarks/results/cost_accuracy.csv   # offline, seconds

One small GPT (2 layers, 256 wide, batch 16 × 128 tokens, fp32, AdamW), planned on the cluster
that ``autopar.compile`` prices when given none: ``cost.cluster.local_cluster()``, asked of a
spawned rank (one thread, as the measured ranks run): without CUDA the ``cpu`` preset with this
host's compute slots, so that 4 ranks on 2 cores share them; or on ``--cluster``, or on a
profiled spec (``--compute measured`` times each op here instead of the roofline), under 8
different forced plans, each run on 2 and on 4 spawned gloo ranks (mesh (2,) and (4,)):

* ``auto``: autopar's own choice; ``auto_mem90``, ``auto_mem80``: autopar under a memory budget
  of 90% and 80% of ``auto``'s predicted peak (skipped where infeasible);
* ``ddp``, ``fsdp``, ``megatron``: the hand plans of ``autopar.solver.planners.hand_plans``;
* ``fsdp_keep``, ``fsdp_reshard``: ``fsdp`` planned and run with ``CommOptions(reshard_after_forward=False)``
  (gathered parameters kept until backward) and ``=True`` (every group freed after forward, the
  root's too); ``fsdp`` runs the default (each layer's group freed, the root's kept);
* ``fsdp_mlp``: only the MLP weights sharded FSDP-style (first divisible dim), the rest replicated;
* ``replicated``: every op output forced replicated (each rank computes the whole step).

Measured, per plan and mesh:

* **step time**: forward + backward + AdamW step, the median over ``--steps`` timed steps (after
  ``--warmup``) of the slowest rank's time, each step started after a barrier; the plans take
  turns step by step (round-robin), so that the shared machine's changing load hits them alike;
* **peak memory per rank**: bytes of tensor storage alive, tracked over one step by a
  ``TorchDispatchMode`` that registers every op's output storages and frees them when the last
  tensor using them dies, on top of what is alive before the step (parameters, AdamW state, the
  input batch). This is the tensors autopar's model can attribute: no allocator caching, no
  kernel workspace, no Python objects. The maximum over ranks.
* **bytes sent**: every collective that ``autopar.ops.collectives`` runs during one step is counted
  (kind, group size, tensor size) and turned into bytes each device sends with the ring formulas
  of ``autopar.cost.comm``.

``--reprice CSV`` runs nothing: it plans the same plans again with today's cost model, on the
cluster each stored row was planned on (``cpu-gloo`` with 2 compute slots: the 2-core machine),
and reports the same figures against the stored measurements, so that a change to the cost
model is checked against real runs in seconds.

Reported: the Spearman rank correlation of predicted and measured step time over all runs
(target >= 0.8), the median relative error of predicted peak memory (target <= 15%), and
predicted / counted bytes (target: equal within 1%).
"""

from __future__ import annotations

import argparse
import copy
import csv
import math
import os
import statistics
import sys
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import autopar  # noqa: E402
from autopar.cost.cluster import ClusterSpec, cpu_cluster, get_cluster, local_cluster  # noqa: E402
from autopar.cost.comm import bytes_sent  # noqa: E402
from autopar.errors import InfeasibleError  # noqa: E402
from autopar.ir.options import PlanOptions  # noqa: E402
from autopar.ir.spec import replicated  # noqa: E402
from autopar.ops import collectives  # noqa: E402
from autopar.ops.params import local_of  # noqa: E402
from autopar.runtime.tools.launch import run_distributed  # noqa: E402
from autopar.solver import solve  # noqa: E402
from autopar.solver.planners.hand_plans import param_specs  # noqa: E402
from autopar.trace import trace  # noqa: E402
from autopar.zoo.models import GPT  # noqa: E402

CONFIG = dict(vocab_size=512, block_size=128, n_layer=2, n_head=4, n_embd=256, bias=True)
BATCH = 16
PLANS = ("auto", "auto_mem90", "auto_mem80", "ddp", "fsdp", "fsdp_keep", "fsdp_reshard", "megatron", "fsdp_mlp", "replicated")
# CommOptions.reshard_after_forward of the plans that do not run the default
RESHARD = {"fsdp_keep": False, "fsdp_reshard": True}


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(**CONFIG)


def example_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    idx = torch.randint(0, CONFIG["vocab_size"], (BATCH, CONFIG["block_size"]), generator=generator)
    targets = torch.randint(0, CONFIG["vocab_size"], (BATCH, CONFIG["block_size"]), generator=generator)
    return idx, targets


def make_plans(mesh: tuple[int, ...], cluster, wanted=PLANS, reshard: bool | str | None = "auto") -> dict[str, autopar.Plan]:
    """The plans, under ``CommOptions(reshard_after_forward=reshard)`` but where ``RESHARD`` names
    another (the schedule a stored run ran: ``reprice``)."""
    traced = trace(build_model(), example_inputs())
    plans: dict[str, autopar.Plan] = {}
    default = PlanOptions(comm=autopar.CommOptions(reshard_after_forward=reshard))
    plans["auto"] = solve(traced, mesh, cluster, default)
    peak = plans["auto"].predicted.peak_memory_bytes
    for name, fraction in (("auto_mem90", 0.9), ("auto_mem80", 0.8)) if set(wanted) & {"auto_mem90", "auto_mem80"} else ():
        try:
            plans[name] = solve(
                traced,
                mesh,
                cluster,
                PlanOptions.from_keywords(memory_budget=fraction * peak, time_limit_s=60, checkpointing=False, comm=default.comm),
            )
        except InfeasibleError as error:
            print(f"  {name} on {mesh}: infeasible ({str(error).splitlines()[0]})", flush=True)
    for kind in ("ddp", "fsdp", "megatron"):
        plans[kind] = solve(traced, mesh, cluster, default, forced=param_specs(kind, traced, mesh))
    for name, reshard in RESHARD.items():
        options = PlanOptions(comm=autopar.CommOptions(reshard_after_forward=reshard))
        plans[name] = solve(traced, mesh, cluster, options, forced=param_specs("fsdp", traced, mesh))
    fsdp = param_specs("fsdp", traced, mesh)
    rest = param_specs("ddp", traced, mesh)
    names = {i.name: i.fqn for i in traced.placeholders("param")}
    plans["fsdp_mlp"] = solve(
        traced,
        mesh,
        cluster,
        default,
        forced={name: fsdp[name] if ".mlp." in (names[name] or "") else spec for name, spec in rest.items()},
    )
    graph = plans["ddp"]
    everything = {
        name: replicated(len(mesh)) for name, node in graph.nodes.items() if node.outs and node.source not in ("follow", "output")
    }
    plans["replicated"] = solve(traced, mesh, cluster, default, forced=everything)
    return plans


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storage alive, and their peak, for tensors made while the mode is on."""

    def __init__(self, known: list[torch.Tensor]):
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in known}
        self.count: dict[int, int] = {}
        self.size: dict[int, int] = {}
        self.seen: set[int] = set()
        self.current = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_leaves(out):
            if isinstance(value, torch.Tensor):
                self._track(value)
        return out

    def _track(self, tensor: torch.Tensor) -> None:
        if id(tensor) in self.seen:
            return
        try:  # a collective's output before its wait has no valid storage yet; the wait returns it
            storage = tensor.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):
            return
        if key == 0 or nbytes == 0 or key in self.known:
            return
        self.seen.add(id(tensor))
        if self.count.get(key, 0) == 0:
            self.size[key] = nbytes
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        self.count[key] = self.count.get(key, 0) + 1
        weakref.finalize(tensor, self._release, id(tensor), key)

    def _release(self, tensor_id: int, key: int) -> None:
        self.seen.discard(tensor_id)
        self.count[key] -= 1
        if self.count[key] == 0:
            self.current -= self.size.pop(key)
            del self.count[key]


class CountBytes:
    """Bytes this rank sends in the collectives of ``autopar.ops.collectives`` while active."""

    def __init__(self) -> None:
        self.sent = 0.0
        self.calls: list[tuple[str, int, int]] = []  # (kind, group size, local bytes)
        self.originals: dict[str, Any] = {}

    def __enter__(self) -> CountBytes:
        def wrap(name: str, kind: str, position: int = 0):
            original = getattr(collectives, name)

            def counted(*args):
                x, group_name = args[position], args[-1]
                k = collectives.group_size(group_name)
                size = x.numel() * x.element_size()
                self.calls.append((kind, k, size))
                # the sizes the cost functions take: all-gather's output, the others' input
                self.sent += bytes_sent(kind, size * k if kind == "all_gather" else size, k)
                return original(*args)

            self.originals[name] = original
            setattr(collectives, name, counted)

        wrap("_all_reduce", "all_reduce")
        wrap("_all_gather", "all_gather")
        wrap("_reduce_scatter", "reduce_scatter")
        wrap("_all_to_all", "all_to_all")
        # the scheduled parameter communication (gradient buckets, parameter gathers)
        wrap("start_all_reduce", "all_reduce")
        wrap("start_reduce_scatter", "reduce_scatter", position=1)
        wrap("start_all_gather", "all_gather", position=1)
        wrap("start_sum", "all_reduce")  # the mean loss's denominator, started early
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self.originals.items():
            setattr(collectives, name, original)


def _local_tensors(pm: torch.nn.Module, optimizer: torch.optim.Optimizer, inputs) -> list[torch.Tensor]:
    tensors = [p.detach() for p in pm.parameters()] + [b for b in pm.buffers()]
    for state in optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    # A plan that shards a parameter holds it (and AdamW its state) as a DTensor, which has no
    # storage of its own: count the local shard's.
    return [local_of(t) for t in tensors + [t for t in inputs if isinstance(t, torch.Tensor)]]


def _bytes_of(tensors: list[torch.Tensor]) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def measure(rank: int, world_size: int, plan_texts: dict[str, str], steps: int, warmup: int) -> dict[str, Any]:
    torch.manual_seed(0)
    base = build_model()
    inputs = example_inputs()
    runs = {}
    for name, text in plan_texts.items():
        plan = autopar.Plan.from_json(text)
        comm = autopar.CommOptions(reshard_after_forward=RESHARD[name]) if name in RESHARD else None
        pm = autopar.compile(copy.deepcopy(base), mesh=plan.mesh_shape, example_inputs=inputs, plan=plan, comm=comm)
        runs[name] = (pm, torch.optim.AdamW(pm.parameters(), lr=1e-4))

    def step(name: str) -> None:
        pm, optimizer = runs[name]
        pm(*inputs).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    # Round-robin over the plans, so that the machine's load at any moment (it is shared) falls
    # on every plan alike instead of on whichever plan ran then.
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_index in range(warmup + steps):
        for name in runs:
            dist.barrier()
            start = time.perf_counter()
            step(name)
            elapsed = _slowest(time.perf_counter() - start)
            if round_index >= warmup:
                times[name].append(elapsed)
    out = {}
    for name, (pm, optimizer) in runs.items():
        known = _local_tensors(pm, optimizer, inputs)
        baseline = _bytes_of(known)
        with CountBytes() as counter, LiveBytes(known) as live:
            step(name)
        peak = torch.tensor([baseline + live.peak], dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        sent = torch.tensor([counter.sent], dtype=torch.float64)
        dist.all_reduce(sent, op=dist.ReduceOp.MAX)
        out[name] = {
            "step_s": statistics.median(times[name]),
            "peak_bytes": float(peak[0]),
            "baseline_bytes": baseline,
            "sent_bytes": float(sent[0]),
            "calls": counter.calls,
        }
    return out


def compile_cluster(rank: int, world_size: int) -> dict[str, Any]:
    return local_cluster().to_json()


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        result = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                result[order[k]] = (i + j) / 2
            i = j + 1
        return result

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))


def reprice(path: str) -> list[dict[str, Any]]:
    """The rows of a stored run (``--out`` of an earlier run) with their plans' predictions made
    again by today's cost model, on the cluster that run planned on (``cpu-gloo`` with 2 slots:
    its ``cluster`` column; ``--compute measured`` runs are not re-priced)."""
    with open(path, newline="") as handle:
        stored = list(csv.DictReader(handle))
    rows = []
    for world in sorted({int(row["ranks"]) for row in stored}):
        here = [row for row in stored if int(row["ranks"]) == world]
        names = {row["cluster"] for row in here}
        if names != {"cpu-gloo (2 slots)"} or {row["compute"] for row in here} != {"roofline"}:
            raise ValueError(f"--reprice knows the 2-core cpu-gloo roofline rows only, got {sorted(names)}")
        cluster = cpu_cluster(threads_per_rank=1, cores=2)
        # the stored runs ran FSDP2's default schedule, as every run did before "auto" (2026-11-30);
        # one planned with another (``schedule`` column) runs as it says
        reshard = _schedule(here)
        plans = make_plans((world,), cluster, [row["plan"] for row in here], reshard)
        for row in here:
            plan = plans[row["plan"]]
            rows.append(
                _row(
                    row["plan"],
                    world,
                    cluster,
                    plan,
                    float(row["measured_step_s"]),
                    float(row["measured_peak_bytes"]),
                    float(row["counted_sent_bytes"]),
                    reshard,
                )
            )
    return rows


def _schedule(rows: list[dict[str, Any]]) -> bool | str | None:
    """``CommOptions.reshard_after_forward`` of a stored run (its ``schedule`` column; None, FSDP2's
    default, for runs from before the column)."""
    values = {row.get("schedule") or "None" for row in rows}
    if len(values) != 1:
        raise ValueError(f"--reprice expects one schedule per world size, got {sorted(values)}")
    return {"None": None, "True": True, "False": False, "auto": "auto"}[values.pop()]


def _row(
    name: str, world: int, cluster, plan, step_s: float, peak_bytes: float, sent_bytes: float, schedule: object = "auto"
) -> dict[str, Any]:
    row = {
        "plan": name,
        "schedule": schedule,  # CommOptions.reshard_after_forward of the plans not in RESHARD
        "ranks": world,
        "cluster": cluster.name,
        "compute": cluster.compute,
        "predicted_step_s": plan.predicted.step_time_s,
        "measured_step_s": step_s,
        "predicted_peak_bytes": plan.predicted.peak_memory_bytes,
        "measured_peak_bytes": int(peak_bytes),
        "predicted_sent_bytes": plan.predicted.comm_bytes,
        "counted_sent_bytes": int(sent_bytes),
    }
    row["memory_rel_err"] = abs(row["predicted_peak_bytes"] - row["measured_peak_bytes"]) / row["measured_peak_bytes"]
    counted = row["counted_sent_bytes"]
    row["sent_ratio"] = (
        row["predicted_sent_bytes"] / counted if counted else (1.0 if not row["predicted_sent_bytes"] else math.inf)
    )
    return row


def report(rows: list[dict[str, Any]], worlds) -> None:
    rho = spearman([r["predicted_step_s"] for r in rows], [r["measured_step_s"] for r in rows])
    per_world = {
        w: spearman(
            [r["predicted_step_s"] for r in rows if r["ranks"] == w], [r["measured_step_s"] for r in rows if r["ranks"] == w]
        )
        for w in worlds
    }
    median_err = statistics.median(r["memory_rel_err"] for r in rows)
    within = sum(abs(r["sent_ratio"] - 1) <= 0.01 for r in rows)
    print(
        f"Spearman(predicted, measured step time) over {len(rows)} runs: {rho:.3f} "
        f"(per world size: {', '.join(f'{w}: {v:.3f}' for w, v in per_world.items())}); target >= 0.8"
    )
    print(f"median relative error of peak memory: {median_err:.1%}; target <= 15%")
    print(f"bytes sent predicted = counted within 1%: {within}/{len(rows)} runs")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/cost_accuracy.csv")
    parser.add_argument(
        "--cluster", default=None, help="preset or ClusterSpec file to plan with (default: what compile prices without one)"
    )
    parser.add_argument("--profile", action="store_true", help="plan with a spec from autopar profile (4 gloo ranks)")
    parser.add_argument(
        "--compute",
        choices=("roofline", "measured"),
        default="roofline",
        help="price ops by the roofline or by timing them here (one thread, as each rank runs)",
    )
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--plans", nargs="+", default=list(PLANS), choices=PLANS, help="which plans to run (auto_mem* need auto)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reprice", metavar="CSV", help="re-price a stored run's plans offline (runs nothing)")
    args = parser.parse_args()
    if args.reprice:
        rows = reprice(args.reprice)
        for row in rows:
            print("  " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        report(rows, sorted({r["ranks"] for r in rows}))
        # A plan that autopar chooses (auto*) may differ today from the one measured: its bytes say so.
        same = [r for r in rows if abs(r["sent_ratio"] - 1) <= 0.01]
        if len(same) < len(rows):
            other = ", ".join(f"{r['plan']} on {r['ranks']}" for r in rows if r not in same)
            rho = spearman([r["predicted_step_s"] for r in same], [r["measured_step_s"] for r in same])
            print(f"plans that differ from the measured ones: {other}; Spearman over the other {len(same)} runs: {rho:.3f}")
        return 0

    if args.profile:
        from autopar.runtime.tools.profile import profile_spawn

        cluster = profile_spawn((max(args.worlds),), quick=True)
        print(f"profiled: {cluster.to_json()}", flush=True)
    elif args.cluster is not None:
        cluster = get_cluster(args.cluster)
    else:  # what compile(..., cluster=None) prices, asked of a spawned rank (it runs one thread)
        cluster = ClusterSpec.from_json(run_distributed(compile_cluster, 1)[0])
    print(f"cluster {cluster.name}: {cluster.to_json()}", flush=True)
    if args.compute == "measured":
        import dataclasses

        torch.set_num_threads(1)  # as each spawned rank runs
        cluster = dataclasses.replace(cluster, compute="measured")
    rows = []
    for world in args.worlds:
        mesh = (world,)
        started = time.perf_counter()
        plans = {name: plan for name, plan in make_plans(mesh, cluster, args.plans).items() if name in args.plans}
        print(f"planned {len(plans)} plans on mesh {mesh} in {time.perf_counter() - started:.1f} s", flush=True)
        texts = {name: plan.to_json() for name, plan in plans.items()}
        started = time.perf_counter()
        measured = run_distributed(measure, world, texts, args.steps, args.warmup, timeout_s=1800)[0]
        print(f"ran them on {world} ranks in {time.perf_counter() - started:.1f} s", flush=True)
        for name, plan in plans.items():
            got = measured[name]
            row = _row(name, world, cluster, plan, got["step_s"], got["peak_bytes"], got["sent_bytes"])
            rows.append(row)
            print("  " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    report(rows, args.worlds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
