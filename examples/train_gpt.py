"""Train a small GPT with autopar on a device mesh, next to an eager copy, and check they agree.

    torchrun --standalone --nproc-per-node 8 examples/train_gpt.py --mesh 2,4
    python examples/train_gpt.py --spawn 8 --mesh 2,4       # the same, without torchrun

Rank 0 plans with ``autopar.plan`` (which needs no process group) and prints the plan's summary.
The plan goes to every rank as JSON, and every rank compiles the model with it. Every rank also
trains an eager copy of the model (same seed, same batches, same AdamW), so the run checks
itself: losses at every step, gradients after the first backward, and the parameters at the end
must agree to a relative difference below ``--tol``. The last line says PASS or FAIL, and the
exit status is non-zero on FAIL.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import autopar
from autopar.runtime.tools.launch import DistributedRankError, max_rel_diff, run_distributed
from autopar.zoo.models import GPT, example_batch

_PLAN_FAILED = "__autopar_demo_plan_failed__"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--spawn", type=int, default=0, metavar="N", help="spawn N gloo processes here instead of running under torchrun"
    )
    parser.add_argument("--mesh", type=parse_mesh, default=(2, 4), help="mesh shape, e.g. 2,4")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=0, help="default: --block-size")
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--fused-qkv", action="store_true", help="one qkv Linear, then split")
    parser.add_argument("--untied", action="store_true", help="do not tie lm_head to wte")
    parser.add_argument(
        "--dtype",
        choices=("float32", "float64"),
        default="float32",
        help="parameter dtype. Losses at every step and the first gradients are "
        "checked in both; final parameters only in float64 (see --tol)",
    )
    parser.add_argument(
        "--bias",
        action="store_true",
        help="give Linear layers biases. Off by default: the key bias has an exactly "
        "zero gradient (softmax cancels it), and AdamW turns the float noise "
        "there into full-size steps, so final parameters would differ in "
        "that one tensor between two correct runs",
    )
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tol", type=float, default=1e-4, help="largest relative difference")
    parser.add_argument(
        "--cluster",
        default="cpu",
        help="ClusterSpec preset or file for planning (default: cpu, the machine "
        "this runs on; on h100-80g prices a model this small stays replicated)",
    )
    parser.add_argument("--memory-budget", type=float, default=None, help="bytes per device")
    parser.add_argument("--plan", default=None, metavar="PATH", help="use this saved plan instead of planning")
    parser.add_argument("--save-plan", default=None, metavar="PATH", help="also save the plan made on rank 0 here")
    parser.add_argument("--pg-timeout", type=float, default=60, help="process-group timeout in seconds")
    parser.add_argument("--plan-timeout", type=float, default=600, help="seconds the other ranks wait for rank 0 to plan")
    parser.add_argument(
        "--timeout", type=float, default=1200, help="with --spawn: seconds for the whole run before every rank is killed"
    )
    args = parser.parse_args(argv)
    args.seq_len = args.seq_len or args.block_size
    return args


def parse_mesh(text: str) -> tuple[int, ...]:
    try:
        mesh = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"mesh must be sizes separated by commas, got {text!r}") from None
    if not mesh or min(mesh) < 1:
        raise argparse.ArgumentTypeError(f"mesh sizes must be positive, got {text!r}")
    return mesh


def log(rank: int, *parts: Any) -> None:
    if rank == 0:
        print(*parts, flush=True)


def build_gpt(args: argparse.Namespace) -> GPT:
    torch.manual_seed(args.seed)
    model = GPT(
        args.vocab_size,
        args.block_size,
        args.n_layer,
        args.n_head,
        args.n_embd,
        tied=not args.untied,
        fused_qkv=args.fused_qkv,
        bias=args.bias,
    )
    return model.to(getattr(torch, args.dtype))


def batch(args: argparse.Namespace, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (-1: the example inputs), the same on every rank."""
    return example_batch(
        "gpt",
        args.batch_size,
        seed=args.seed + 1000 + step,
        vocab_size=args.vocab_size,
        block_size=args.block_size,
        seq_len=args.seq_len,
    )


def make_plan_json(rank: int, args: argparse.Namespace, model: GPT) -> str:
    """On rank 0: plan (or read ``--plan``), print the summary, and return the plan file's text."""
    if args.plan:
        log(rank, f"using the saved plan {args.plan}")
        with open(args.plan) as file:
            return file.read()
    start = time.perf_counter()
    plan = autopar.plan(
        model, mesh=args.mesh, example_inputs=batch(args, -1), cluster=args.cluster, memory_budget=args.memory_budget
    )
    plan_s = time.perf_counter() - start
    log(rank, plan.summary())
    log(rank, f"planned in {plan_s:.2f} s")
    with tempfile.TemporaryDirectory() as tmpdir:
        path = os.path.join(tmpdir, "plan.json")
        plan.save(path)
        with open(path) as file:
            text = file.read()
    if args.save_plan:
        plan.save(args.save_plan)
        log(rank, f"saved the plan to {args.save_plan}")
    return text


def share_plan(rank: int, args: argparse.Namespace, model: GPT, workdir: str) -> str:
    """Plan on rank 0, send the JSON to every rank, and return the path of this rank's copy.

    The plan travels over its own process group with a long timeout, because planning can take
    longer than the main group's timeout. Sending the text, not a path, works across machines.
    """
    plan_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=args.plan_timeout))
    box: list[Any] = [None]
    error: BaseException | None = None
    if rank == 0:
        try:
            box[0] = make_plan_json(rank, args, model)
        except BaseException as exc:  # noqa: BLE001 - the other ranks must hear of it, then re-raise
            box[0], error = (_PLAN_FAILED, traceback.format_exc()), exc
    dist.broadcast_object_list(box, src=0, group=plan_group)
    dist.destroy_process_group(plan_group)
    if error is not None:
        raise error
    if isinstance(box[0], tuple) and box[0][0] == _PLAN_FAILED:
        # Carries rank 0's traceback, since this error may be the first one reported.
        raise RuntimeError(f"rank 0 failed to make the plan:\n{box[0][1]}")
    path = os.path.join(workdir, f"plan_rank{rank}.json")
    with open(path, "w") as file:
        file.write(box[0])
    return path


def named_like_eager(got: dict[str, torch.Tensor], eager: torch.nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """``got`` restricted to ``names``; a name that ``got`` lacks may be found under an alias
    (a tied parameter has two names in ``state_dict`` and one in ``named_parameters``)."""
    by_id: dict[int, list[str]] = {}
    for fqn, tensor in eager.state_dict(keep_vars=True).items():
        by_id.setdefault(id(tensor), []).append(fqn)
    tensors = dict(eager.state_dict(keep_vars=True))
    selected = {}
    for name in names:
        aliases = [name] + [a for a in by_id.get(id(tensors.get(name)), []) if a != name]
        found = next((a for a in aliases if a in got), None)
        if found is None:
            raise KeyError(f"{name!r} (aliases {aliases[1:]}) is missing; got {sorted(got)}")
        selected[name] = got[found]
    return selected


def worst(diffs: dict[str, float]) -> tuple[str, float]:
    name = max(diffs, key=lambda key: diffs[key])
    return name, diffs[name]


def train(rank: int, world_size: int, args: argparse.Namespace) -> bool:
    """One rank of the demo; the process group is already initialized. Returns whether it passed."""
    if math.prod(args.mesh) != world_size:
        raise ValueError(f"mesh {args.mesh} has {math.prod(args.mesh)} devices, but the world size is {world_size}")
    torch.set_num_threads(1)
    log(
        rank,
        f"autopar demo: GPT(vocab={args.vocab_size}, block={args.block_size}, "
        f"layers={args.n_layer}, heads={args.n_head}, embd={args.n_embd}, "
        f"tied={not args.untied}, fused_qkv={args.fused_qkv}) on mesh {args.mesh}, "
        f"world size {world_size}, batch {args.batch_size}x{args.seq_len}",
    )
    model, eager = build_gpt(args), build_gpt(args)
    eager_param_names = [fqn for fqn, _ in eager.named_parameters()]

    with tempfile.TemporaryDirectory() as workdir:
        plan_path = share_plan(rank, args, model, workdir)
        start = time.perf_counter()
        pm = autopar.compile(
            model,
            mesh=args.mesh,
            example_inputs=batch(args, -1),
            plan=plan_path,
            cluster=args.cluster,
            memory_budget=args.memory_budget,
        )
        log(rank, f"compiled in {time.perf_counter() - start:.2f} s")

    opt = torch.optim.AdamW(pm.parameters(), lr=args.lr)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=args.lr)
    loss_diffs, pm_times, eager_times = [], [], []
    grad_diffs: dict[str, float] = {}
    for step in range(args.steps):
        idx, targets = batch(args, step)

        start = time.perf_counter()
        loss = pm(idx, targets)
        loss.backward()
        backward_done = time.perf_counter()
        if step == 0:  # gathered outside the timed part of the step
            full_grads = pm.full_grads()
        step_start = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        pm_times.append(time.perf_counter() - step_start + backward_done - start)

        start = time.perf_counter()
        eager_loss = eager(idx, targets)
        eager_loss.backward()
        backward_done = time.perf_counter()
        if step == 0:
            eager_grads = {fqn: p.grad.clone() for fqn, p in eager.named_parameters()}
        step_start = time.perf_counter()
        eager_opt.step()
        eager_opt.zero_grad(set_to_none=True)
        eager_times.append(time.perf_counter() - step_start + backward_done - start)

        got, want = loss.detach().item(), eager_loss.detach().item()
        loss_diffs.append(abs(got - want) / max(abs(want), 1e-12))
        log(
            rank,
            f"step {step}  loss autopar={got:.6f} eager={want:.6f}  "
            f"rel diff={loss_diffs[-1]:.2e}  "
            f"(autopar {pm_times[-1] * 1e3:.0f} ms, eager {eager_times[-1] * 1e3:.0f} ms)",
        )
        if step == 0:
            grad_diffs = max_rel_diff(named_like_eager(full_grads, eager, eager_param_names), eager_grads)

    state_names = list(eager.state_dict())
    param_diffs = max_rel_diff(
        named_like_eager(pm.full_state_dict(), eager, state_names), {fqn: t for fqn, t in eager.state_dict().items()}
    )

    checks = [("loss", "max over steps", max(loss_diffs, default=0.0))]
    if grad_diffs:
        checks.append(("gradient", *worst(grad_diffs)))
    if args.dtype == "float64":
        checks.append(("final parameter", *worst(param_diffs)))
    passed = all(diff < args.tol for _, _, diff in checks)
    if pm_times:
        steady, steady_eager = pm_times[1:] or pm_times, eager_times[1:] or eager_times
        log(
            rank,
            f"time per step after the first: autopar {_mean_ms(steady):.1f} ms, eager "
            f"{_mean_ms(steady_eager):.1f} ms (first step: autopar {pm_times[0] * 1e3:.0f} "
            f"ms, eager {eager_times[0] * 1e3:.0f} ms)",
        )
    for kind, name, diff in checks:
        log(rank, f"  largest {kind} rel diff: {diff:.2e} ({name})")
    if args.dtype != "float64":
        # AdamW's first step moves every element by ±lr by the sign of its gradient, so where a
        # gradient is at float32 rounding level two correct runs can step apart by 2·lr. The
        # losses above depend on every parameter, and are checked at every step.
        log(
            rank,
            f"  final parameters, for information (checked with --dtype float64): largest rel "
            f"diff {worst(param_diffs)[1]:.2e} ({worst(param_diffs)[0]})",
        )
    if passed:
        log(rank, f"PASS: autopar matches eager (rel diff < {args.tol:g}) over {args.steps} steps on mesh {args.mesh}")
    else:
        log(rank, f"FAIL: autopar differs from eager by more than {args.tol:g} (see above)")
    return passed


def _mean_ms(times_s: list[float]) -> float:
    return sum(times_s) / len(times_s) * 1e3


def _init_and_train(args: argparse.Namespace) -> int:
    """Under torchrun: join the process group, train, leave. Returns the exit status."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    try:
        passed = train(rank, world_size, args)
        # A rank that fails must not leave before the others gathered with it; then agree.
        verdict = torch.tensor([0 if passed else 1])
        dist.all_reduce(verdict)
        return 0 if int(verdict) == 0 else 1
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if not args.spawn and not under_torchrun:
        args.spawn = math.prod(args.mesh)
        print(f"not under torchrun: spawning {args.spawn} processes (as --spawn {args.spawn})", flush=True)
    if not args.spawn:
        return _init_and_train(args)
    if math.prod(args.mesh) != args.spawn:
        print(f"error: mesh {args.mesh} needs {math.prod(args.mesh)} processes, but --spawn is {args.spawn}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    try:
        results = run_distributed(train, args.spawn, args, timeout_s=args.timeout, pg_timeout_s=args.pg_timeout)
    except (DistributedRankError, TimeoutError) as exc:
        print(f"FAIL: the run did not complete:\n{exc}", file=sys.stderr, flush=True)
        return 1
    print(f"total wall time with --spawn {args.spawn}: {time.perf_counter() - start:.1f} s", flush=True)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
