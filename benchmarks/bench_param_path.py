"""Host time per step phase: autopar's DTensor parameter path against FSDP2 and DDP (gloo, CPU).

    python benchmarks/bench_param_path.py                       # 1, 2 and 4 ranks
    python benchmarks/bench_param_path.py --ranks 2 --optimizer fused --steps 20
    python benchmarks/bench_param_path.py --route   # the gradient hand-off per parameter, one process

A GPT small enough that the host, not the arithmetic, sets the step time (``autopar.zoo``'s GPT,
4 layers, 64 wide, 4 heads, vocabulary 256, 8 sequences of 32 tokens: 68 parameter tensors of a
few KiB each). For each world size one set of spawned gloo ranks (one thread each) builds the
trainers of ``bench_vs_torch.build`` for the same model (``eager_local``: the plain model on the
rank's rows, no communication; ``torch_ddp``; ``torch_fsdp2``; ``autopar_ddp``; ``autopar_fsdp``;
``--kinds`` can add ``torch_replicate``, FSDP2's machinery with every parameter replicated, and
``autopar_ddp_check_apart``, autopar's ddp whose data check never carries the loss's all-reduce:
two collectives a forward, as before ``runtime.data`` let them ride together), and
``autopar_ddp_priced_apart`` (or ``autopar_fsdp_priced_apart``), the hand plan made with the loss's
all-reduce priced as a collective of its own (``op_prices.pricing_without_rides``: at 4 ranks this
GPT's plan then gathers the logits),
each with torch's AdamW (``--optimizer``: default, foreach or fused). The trainers take turns step
by step; each phase (``zero_grad``, forward, backward, ``optimizer.step()``) is timed with
``time.process_time`` (the rank's CPU time: what the host spends, not what it waits for peers).
A phase's figure is its median over ``--steps`` steps on the slowest rank, in microseconds.
Ratios: ``<phase>_<autopar kind>_over_<torch kind>`` for autopar's ddp against DDP and against
``torch_replicate``, and its fsdp against FSDP2; ``host_over_eager`` for each trainer: its whole
step's CPU time over the plain model's, which carries no parameter path at all. Writes ``results/param_path.csv``.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench_vs_torch import OPTIMIZERS, _batch, _gpt, build

CONFIG = dict(vocab_size=256, block_size=32, n_layer=4, n_head=4, n_embd=64)
BATCH = 8
KINDS = ("eager_local", "torch_ddp", "torch_fsdp2", "autopar_ddp", "autopar_fsdp")
PHASES = ("zero_grad", "forward", "backward", "step")
# autopar's ddp against DDP (plain tensors) and against torch_replicate (FSDP2's machinery, every
# parameter a replicated DTensor: the same layout as autopar's), its fsdp against FSDP2.
PAIRS = (
    ("autopar_ddp", "torch_ddp"),
    ("autopar_ddp", "torch_replicate"),
    ("autopar_fsdp", "torch_fsdp2"),
    ("autopar_ddp", "autopar_ddp_check_apart"),
    ("autopar_ddp", "autopar_ddp_priced_apart"),
    ("autopar_fsdp", "autopar_fsdp_priced_apart"),
)
_APART = "_check_apart"
_PRICED_APART = "_priced_apart"


def _build(kind: str, world: int, rank: int):
    """``bench_vs_torch.build``, but for ``*_priced_apart``: the plan priced without the ride."""
    if not kind.endswith(_PRICED_APART):
        return build(kind.removesuffix(_APART), world, rank, CONFIG, BATCH)
    import autopar  # as in bench_vs_torch.build: imported where a kind needs it
    from autopar.solver.problem.op_prices import pricing_without_rides

    model, (idx, targets) = _gpt(CONFIG), _batch(CONFIG, BATCH)
    hand = kind.removeprefix("autopar_").removesuffix(_PRICED_APART)
    with pricing_without_rides():
        plan = autopar.hand_plan(hand, model, (world,), example_inputs=(idx, targets), cluster="cpu")
    return autopar.compile(model, (world,), example_inputs=(idx, targets), plan=plan), (idx, targets)


def _phases(module, batch, optimizer) -> dict[str, float]:
    """One training step, the CPU seconds of each phase."""
    marks = [time.process_time()]
    optimizer.zero_grad()
    marks.append(time.process_time())
    loss = module(*batch)
    marks.append(time.process_time())
    loss.backward()
    marks.append(time.process_time())
    optimizer.step()
    marks.append(time.process_time())
    return {phase: marks[k + 1] - marks[k] for k, phase in enumerate(PHASES)}


def _rank(rank: int, world: int, init: str, out_dir: str, kinds: list[str], steps: int, optimizer: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        trainers = {}
        for kind in kinds:
            module, batch = _build(kind, world, rank)
            if kind.endswith(_APART):  # never learns to defer its check to the loss's all-reduce
                module._learn_riding = lambda attr, settle: None
            trainers[kind] = (module, batch, torch.optim.AdamW(module.parameters(), lr=1e-3, **OPTIMIZERS[optimizer]))
        times: dict[str, list[dict[str, float]]] = {kind: [] for kind in kinds}
        for _ in range(3):  # warm-up
            for module, batch, adamw in trainers.values():
                _phases(module, batch, adamw)
        for _ in range(steps):  # round-robin: the machine's drift falls on every trainer alike
            for kind, (module, batch, adamw) in trainers.items():
                dist.barrier()
                times[kind].append(_phases(module, batch, adamw))
        medians = {f"{kind}_{phase}": statistics.median(t[phase] for t in times[kind]) for kind in kinds for phase in PHASES}
        medians.update({f"{kind}_total": statistics.median(sum(t.values()) for t in times[kind]) for kind in kinds})
        gathered: list = [None] * world
        dist.all_gather_object(gathered, medians)
        if rank == 0:
            with open(os.path.join(out_dir, "result.csv"), "w") as handle:
                for key in medians:
                    handle.write(f"{key},{max(g[key] for g in gathered)}\n")
    finally:
        dist.destroy_process_group()


def run(world: int, kinds: list[str], steps: int, optimizer: str) -> dict[str, float]:
    """{"<kind>_<phase>": CPU seconds} for every kind and phase (and ``_total``), slowest rank."""
    with tempfile.TemporaryDirectory(prefix="param_path_") as out_dir:
        init = "file://" + os.path.join(out_dir, "rendezvous")
        mp.spawn(_rank, args=(world, init, out_dir, kinds, steps, optimizer), nprocs=world, join=True)
        with open(os.path.join(out_dir, "result.csv")) as handle:
            return {key: float(seconds) for key, seconds in (line.strip().split(",") for line in handle)}


def ratios(seconds: dict[str, float]) -> dict[str, float]:
    out = {}
    for ours, theirs in PAIRS:
        for phase in (*PHASES, "total"):
            if f"{ours}_{phase}" in seconds and f"{theirs}_{phase}" in seconds and seconds[f"{theirs}_{phase}"] > 0:
                out[f"{phase}_{ours}_over_{theirs}"] = round(seconds[f"{ours}_{phase}"] / seconds[f"{theirs}_{phase}"], 3)
    if "eager_local_total" in seconds:
        for key, value in seconds.items():
            if key.endswith("_total") and key != "eager_local_total":
                out[f"{key.removesuffix('_total')}_host_over_eager"] = round(value / seconds["eager_local_total"], 3)
    return out


def route_us(num_params: int = 68, repeat: int = 100) -> float:
    """CPU microseconds per parameter of the backward's gradient hand-off alone, in this process:
    for each of ``num_params`` replicated 64 x 64 DTensor parameters, ``LocalLeaf.get()`` (what
    forward reads) and the leaf's post-accumulate hook with a gradient (what backward runs), after
    ``zero_grad(set_to_none=True)``; the best of 5 rounds."""
    from torch.distributed.tensor import Replicate, distribute_tensor, init_device_mesh

    from autopar.ops.params import LocalLeaf

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (1,))
    params = [torch.nn.Parameter(distribute_tensor(torch.randn(64, 64), mesh, [Replicate()])) for _ in range(num_params)]
    leaves = [LocalLeaf(param) for param in params]
    grads = [torch.randn(64, 64) for _ in params]
    best = float("inf")
    for _ in range(5):
        begin = time.process_time()
        for _ in range(repeat):
            for param in params:
                param.grad = None
            for holder, grad in zip(leaves, grads):
                leaf = holder.get()
                leaf.grad = grad
                holder._route(leaf)
        best = min(best, (time.process_time() - begin) / repeat / num_params)
    return 1e6 * best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", nargs="*", type=int, default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--kinds", nargs="*", default=list(KINDS))
    parser.add_argument("--optimizer", choices=list(OPTIMIZERS), default="default")
    parser.add_argument("--out", default="benchmarks/results/param_path.csv")
    parser.add_argument("--route", action="store_true", help="only the per-parameter gradient hand-off, in this process")
    args = parser.parse_args()
    if args.route:
        print(f"LocalLeaf.get + _route: {route_us():.2f} us per parameter (load {os.getloadavg()[0]:.1f})")
        return
    rows = []
    for world in args.ranks:
        seconds = run(world, args.kinds, args.steps, args.optimizer)
        row = {"ranks": world, "optimizer": args.optimizer, "load": round(os.getloadavg()[0], 2)}
        row.update({f"{key}_us": round(1e6 * s) for key, s in seconds.items()})
        row.update(ratios(seconds))
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
