"""autopar against PyTorch's own data parallelism, on their own layouts, in one run (gloo, CPU).

    python benchmarks/bench_vs_torch.py                 # 2 and 4 ranks
    python benchmarks/bench_vs_torch.py --ranks 2 --steps 8 --warmup 2

For each world size, one set of spawned gloo ranks (one thread each) builds five trainers of the
same GPT (``autopar.zoo.models.GPT``: 4 layers, 256 wide, 8 heads, vocabulary 4,096, tied embeddings,
global batch 16 x 128 tokens, AdamW):

- ``torch_ddp``: ``DistributedDataParallel`` (its default 25 MiB buckets), each rank its slice
  of the batch;
- ``autopar_ddp``: ``autopar.compile`` of ``autopar.hand_plan("ddp", ...)`` on mesh (world,);
- ``torch_fsdp2``: FSDP2, ``fully_shard`` on every block and then on the root, on a CPU device
  mesh (so it stays on the CPU where CUDA is visible);
- ``autopar_fsdp``: ``autopar.compile`` of ``autopar.hand_plan("fsdp", ...)``;
- ``autopar``: ``autopar.compile`` with no plan and no cluster: autopar's own plan, priced for
  the machine it runs on (``cost.cluster.local_cluster``: on a CPU, gloo's links and the host's
  cores shared among its ranks).

Compiled variants, in the same run (a ``_compiled`` suffix):

- ``torch_ddp_compiled``: ``torch.compile`` of the DDP module (dynamo's DDPOptimizer splits the
  graph at DDP's buckets);
- ``torch_fsdp2_compiled``: FSDP2 with each block compiled before ``fully_shard``, as torchtitan
  does (``block.compile()``);
- ``autopar_ddp_compiled``, ``autopar_fsdp_compiled``, ``autopar_compiled``: the three autopar
  trainers with ``autopar.compile(..., compiler="inductor")`` (its own plan then priced for
  inductor's executor).

``--kinds`` can add ``torch_replicate``: torch's own data parallelism on DTensor parameters
(``torch.distributed._composable.replicate_with_fsdp.replicate``, FSDP2's machinery with every
parameter replicated), the like-for-like layout of autopar's ``ddp`` plan, whose parameters are
DTensors too (``ddp_over_dtensor_ddp``); ``autopar_fsdp_kept``: the fsdp hand plan under the schedule
the planner chooses (its layers kept gathered from forward to backward where memory allows; the
other hand plans run FSDP2's default, as ``torch_fsdp2`` does: ``fsdp_kept_ratio``);
``autopar_ddp_sync`` and ``autopar_fsdp_sync``: the same hand plans compiled
with ``autopar.CommOptions(enabled=False)``, one synchronous collective per use (the executor
before communication was scheduled); and ``eager_local``: the plain model on each rank's slice of
the batch with no communication at all, the floor that data parallelism's overhead is measured
from (``floor_over_best_torch``: its step over the best of torch's; a plan that computes as eager
cannot go below it but by sharding the optimizer's work).

After ``--warmup`` steps each, the trainers take turns step by step (zero_grad, forward,
backward, optimizer step; a barrier before each), ``--steps`` timed steps each, so that the
machine's drift falls on all of them alike; each round starts one trainer later than the last,
so that no trainer always runs right after the same one. A trainer's time is the median of its
timed steps on the slowest rank; ``<kind>_cpu_ms`` is the same for the CPU time the rank's
process spent in the step (``time.process_time``, gloo's threads included), which other jobs on a
shared machine disturb far less than wall time but which leaves out time spent waiting for the
other rank, and the ``..._cpu`` ratios are taken from it; ``<kind>_opt_ms`` is the same for its
``optimizer.step()`` alone (torch's AdamW
over the module's parameters: DTensors for FSDP2 and autopar, plain tensors for DDP; ``--optimizer
foreach`` makes it ``foreach=True``, CUDA's default, and ``--optimizer fused`` ``fused=True``,
torchtitan's default, in every trainer). ``--accum N`` makes a step N micro-steps (forward and
backward), every one but the last without gradient sync, as each library offers it. Ratios are taken within the run;
absolute times on this shared machine mean little. ``own_plan`` names the hand plan whose layout
autopar's own plan is (every parameter's and op's placements and the data layout the same:
``ddp``, ``fsdp``), or ``own``: where it is a hand plan's, the own plan's trainer runs the same
program as that hand plan's and the two differ only by the machine's noise. Uses only the public
API (``autopar.compile``, ``autopar.hand_plan``, ``autopar.plan``) and torch. Writes
``results/vs_torch.csv``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import datetime
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CONFIG = dict(vocab_size=4096, block_size=128, n_layer=4, n_head=8, n_embd=256)
BATCH = 16
TRAINERS = (
    "torch_ddp",
    "autopar_ddp",
    "torch_fsdp2",
    "autopar_fsdp",
    "autopar",
    "torch_ddp_compiled",
    "autopar_ddp_compiled",
    "torch_fsdp2_compiled",
    "autopar_fsdp_compiled",
    "autopar_compiled",
)


def _gpt(config: dict = CONFIG):
    try:
        from autopar.zoo import GPT
    except ImportError:  # before the package re-layout
        from autopar.zoo.models import GPT
    torch.manual_seed(0)
    return GPT(**config)


def _batch(config: dict = CONFIG, batch: int = BATCH):
    generator = torch.Generator().manual_seed(1)
    idx = torch.randint(0, config["vocab_size"], (batch, config["block_size"]), generator=generator)
    targets = torch.randint(0, config["vocab_size"], (batch, config["block_size"]), generator=generator)
    return idx, targets


OPTIMIZERS = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}
# Each of them as autopar's plans are told it (``optimizer=``), so that they price the step it runs.
DECLARED = {"default": "adamw", "foreach": "adamw:foreach", "fused": "adamw:fused"}


@contextlib.contextmanager
def _no_sync(module: torch.nn.Module, sync: bool):
    """The context a micro-step runs in: DDP's and autopar's ``no_sync()``, FSDP2's and
    replicate's ``set_requires_gradient_sync``; nothing for the plain model or a synced step."""
    if sync or not hasattr(module, "no_sync") and not hasattr(module, "set_requires_gradient_sync"):
        yield
    elif hasattr(module, "no_sync"):
        with module.no_sync():
            yield
    else:
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)


def _trainer(kind: str, world: int, rank: int, optimizer: str = "default", accum: int = 1):
    """(step function, module) for one trainer; ``optimizer``: AdamW's implementation
    (``OPTIMIZERS``); ``accum``: micro-steps per optimizer step, every one but the last without
    gradient sync. A step returns its wall seconds, its optimizer's, and its CPU seconds."""
    module, batch = build(kind, world, rank, optimizer=DECLARED[optimizer])
    adamw = torch.optim.AdamW(module.parameters(), lr=1e-4, **OPTIMIZERS[optimizer])

    def step() -> tuple[float, float, float]:
        start, cpu = time.perf_counter(), time.process_time()
        adamw.zero_grad()
        for micro in range(accum):
            with _no_sync(module, micro == accum - 1):
                module(*batch).backward()
        stepping = time.perf_counter()
        adamw.step()
        end = time.perf_counter()
        return end - start, end - stepping, time.process_time() - cpu

    return step, module


def _layout(module: torch.nn.Module) -> str | None:
    """The placements of ``module``'s plan (parameters, ops, data layout) as one JSON text, costs
    left out; None for a module that is not autopar's."""
    plan = getattr(module, "plan", None)
    if plan is None:
        return None
    data = json.loads(plan.to_json())
    nodes = {name: {k: v for k, v in node.items() if k != "cost_s"} for name, node in data["nodes"].items()}
    return json.dumps([data["mesh"], data["params"], nodes, data.get("data")], sort_keys=True)


def own_plan_is(layouts: dict[str, str | None], suffix: str = "") -> str | None:
    """Which hand plan autopar's own plan is (``own_plan`` in the module docstring) among the
    trainers whose names end in ``suffix``, from their ``_layout``s: "ddp", "fsdp", "own" where it
    is neither, None without its trainer."""
    own = layouts.get(f"autopar{suffix}")
    if own is None:
        return None
    same = [name for name in ("ddp", "fsdp") if layouts.get(f"autopar_{name}{suffix}") == own]
    return same[0] if same else "own"


def build(
    kind: str, world: int, rank: int, config: dict = CONFIG, batch_size: int = BATCH, optimizer: str = "adamw"
) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """(module, this rank's batch) of one trainer ``kind`` (``TRAINERS``, or the ``--kinds`` extras)
    on the GPT ``config`` and a global batch of ``batch_size`` sequences; autopar's plans priced for
    ``optimizer`` (``DECLARED``)."""
    import autopar

    model = _gpt(config)
    idx, targets = _batch(config, batch_size)
    compiled = kind.endswith("_compiled")
    kind = kind.removesuffix("_compiled")
    if kind == "eager_local":
        module = model
        batch = (idx.chunk(world)[rank], targets.chunk(world)[rank])
    elif kind == "torch_ddp":
        from torch.nn.parallel import DistributedDataParallel

        module = DistributedDataParallel(model)
        if compiled:  # dynamo's DDPOptimizer splits the graph at DDP's buckets
            module = torch.compile(module)
        batch = (idx.chunk(world)[rank], targets.chunk(world)[rank])
    elif kind in ("torch_fsdp2", "torch_replicate"):
        from torch.distributed._composable.replicate_with_fsdp import replicate
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # An explicit CPU mesh: without it, fully_shard moves the model to the GPU wherever
        # CUDA is visible, and FSDP2 would be timed on another device than the others.
        wrap = fully_shard if kind == "torch_fsdp2" else replicate
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard" if wrap is fully_shard else "replicate",))
        for block in model.transformer.h:
            if compiled:  # torchtitan's order: compile each block, then shard it
                block.compile()
            wrap(block, mesh=mesh)
        module = wrap(model, mesh=mesh)
        batch = (idx.chunk(world)[rank], targets.chunk(world)[rank])
    else:
        mesh = (world,)
        comm = autopar.CommOptions(enabled=not kind.endswith("_sync"))
        kept = kind.endswith("_kept")
        kind = kind.removesuffix("_sync").removesuffix("_kept")
        if kind == "autopar":
            plan = None  # what ``autopar.compile(model, mesh)`` plans by itself, for the machine it runs on
        else:
            # FSDP2's default schedule, as the torch trainers run it (the own plan, and a ``_kept``
            # hand plan, keep what the planner chooses: ``CommOptions(reshard_after_forward="auto")``)
            comm = comm if kept else dataclasses.replace(comm, reshard_after_forward=None)
            plan = autopar.hand_plan(
                kind.removeprefix("autopar_"),
                model,
                mesh,
                example_inputs=(idx, targets),
                cluster="cpu",
                optimizer=optimizer,
                comm=comm,
            )
        module = autopar.compile(
            model,
            mesh,
            example_inputs=(idx, targets),
            plan=plan,
            comm=comm,
            compiler="inductor" if compiled else None,
            optimizer=optimizer,
        )
        batch = (idx, targets)  # the compiled module cuts out its own shard
    return module, batch


def _rank(
    rank: int, world: int, init: str, out_dir: str, kinds: list[str], steps: int, warmup: int, optimizer: str, accum: int
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        built = {kind: _trainer(kind, world, rank, optimizer, accum) for kind in kinds}
        trainers = {kind: step for kind, (step, _) in built.items()}
        layouts = {kind: _layout(module) for kind, (_, module) in built.items()}
        owns = {f"own{suffix}_plan": own_plan_is(layouts, suffix) for suffix in ("", "_compiled")}
        times: dict[str, list[tuple[float, float, float]]] = {kind: [] for kind in kinds}
        for step in trainers.values():
            for _ in range(warmup):
                step()
        order = list(trainers)
        for round_ in range(steps):  # round-robin, step by step: the machine's drift hits all alike
            first = round_ % len(order)  # and no trainer always follows the same one
            for kind in order[first:] + order[:first]:
                dist.barrier()
                times[kind].append(trainers[kind]())
        medians = {}
        for index, name in enumerate(("", "_opt", "_cpu")):
            medians.update({f"{kind}{name}": statistics.median(s[index] for s in t) for kind, t in times.items()})
        gathered: list = [None] * world
        dist.all_gather_object(gathered, medians)
        if rank == 0:
            with open(os.path.join(out_dir, "result.csv"), "w") as handle:
                for key in medians:
                    handle.write(f"{key},{max(g[key] for g in gathered)}\n")
                for key, own in owns.items():
                    if own is not None:
                        handle.write(f"{key},{own}\n")
    finally:
        dist.destroy_process_group()


def run(
    world: int, kinds: list[str], steps: int, warmup: int, optimizer: str = "default", accum: int = 1
) -> dict[str, float | str]:
    """The slowest rank's medians (seconds: ``<kind>``, ``<kind>_opt``, ``<kind>_cpu``) and
    ``own_plan``, ``own_compiled_plan`` (``own_plan_is``) where the own plan's trainer ran."""
    with tempfile.TemporaryDirectory(prefix="vs_torch_") as out_dir:
        init = "file://" + os.path.join(out_dir, "rendezvous")
        mp.spawn(_rank, args=(world, init, out_dir, kinds, steps, warmup, optimizer, accum), nprocs=world, join=True)
        with open(os.path.join(out_dir, "result.csv")) as handle:
            pairs = [line.strip().split(",") for line in handle]
            return {key: value if key.endswith("_plan") else float(value) for key, value in pairs}


def _ratios(step_s: dict[str, float], suffix: str) -> dict[str, float]:
    """autopar over torch on each layout, and autopar's own plan over the best of torch, among
    the trainers whose names end in ``suffix`` ("" or "_compiled")."""
    got = {kind.removesuffix(suffix): s for kind, s in step_s.items() if kind.endswith(suffix)}
    out = {}
    pairs = (("autopar_ddp", "torch_ddp", "ddp"), ("autopar_fsdp", "torch_fsdp2", "fsdp"))
    for ours, theirs, name in pairs + (("autopar_fsdp_kept", "torch_fsdp2", "fsdp_kept"),):
        if ours in got and theirs in got:
            out[f"{name}{suffix}_ratio"] = round(got[ours] / got[theirs], 3)
    if "autopar_ddp" in got and "torch_replicate" in got:  # both on DTensor parameters
        out[f"ddp{suffix}_over_dtensor_ddp{suffix}"] = round(got["autopar_ddp"] / got["torch_replicate"], 3)
    best = [got[k] for k in ("torch_ddp", "torch_fsdp2") if k in got]
    if "autopar" in got and best:
        out[f"own{suffix}_over_best_torch{suffix}"] = round(got["autopar"] / min(best), 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", nargs="*", type=int, default=[2, 4])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--kinds", nargs="*", default=list(TRAINERS))
    parser.add_argument("--out", default="benchmarks/results/vs_torch.csv")
    parser.add_argument(
        "--optimizer",
        choices=list(OPTIMIZERS),
        default="default",
        help="AdamW's implementation in every trainer: torch's default (on the CPU a loop over parameters, one "
        "DTensor dispatch per op and parameter for FSDP2 and autopar), foreach (CUDA's default) or fused "
        "(torchtitan's default)",
    )
    parser.add_argument(
        "--accum",
        type=int,
        default=1,
        help="micro-steps per optimizer step, every one but the last under no_sync() (DDP, autopar) or "
        "set_requires_gradient_sync(False) (FSDP2, replicate)",
    )
    args = parser.parse_args()
    rows = []
    for world in args.ranks:
        measured = run(world, args.kinds, args.steps, args.warmup, args.optimizer, args.accum)
        row: dict[str, object] = {"ranks": world}
        row.update({key: value for key, value in measured.items() if isinstance(value, str)})
        step_s = {kind: float(s) for kind, s in measured.items() if not isinstance(s, str)}
        row.update({f"{kind}_ms": round(1e3 * s, 1) for kind, s in step_s.items()})
        best = [step_s[k] for k in ("torch_ddp", "torch_fsdp2") if k in step_s]
        walls = {k: s for k, s in step_s.items() if not k.endswith(("_opt", "_cpu"))}
        cpus = {k.removesuffix("_cpu"): s for k, s in step_s.items() if k.endswith("_cpu")}
        for suffix in ("", "_compiled"):  # the same ratios among the uncompiled and the compiled trainers
            row.update(_ratios(walls, suffix))
            row.update({f"{key}_cpu": ratio for key, ratio in _ratios(cpus, suffix).items()})
        if "autopar_compiled" in step_s and "autopar" in step_s:
            row["own_compiled_over_uncompiled"] = round(step_s["autopar_compiled"] / step_s["autopar"], 3)
        if "eager_local" in step_s and best:
            # The no-communication floor against the best of torch: what a plan that computes
            # as eager does (every data-parallel plan) could reach if communication cost nothing.
            row["floor_over_best_torch"] = round(step_s["eager_local"] / min(best), 3)
        rows.append(row)
        print(row, flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    fields = list(dict.fromkeys(key for row in rows for key in row))
    with open(args.out, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
