"""Where a budgeted plan's CPU time goes beyond the unbounded plan's, phase by phase (issue 48).

    python benchmarks/profile_budget.py --models gpt-oss --layers 2 --state-budget 0.6
    python benchmarks/profile_budget.py --models llama --layers 48 --default-budget

Plans one traced model (``bench_plan_time.build``: same models, meshes and budgets) unbounded and
under the budget, both once untimed (as ``bench_plan_time.py`` warms them), then ``--repeat``
times each, alternately. Each phase is a function of the planner, timed in CPU seconds
(``time.process_time``) by a wrapper around it for this process only; nested phases are counted
in their callers too, so the rows do not add up. Printed: the minimum over the repeats of each
phase, unbounded and budgeted, and their difference, largest first; then each LP solve of the
last budgeted plan: whether its objective was priced (a Lagrangian step), simplex iterations from
the basis the model held, and its CPU seconds in HiGHS. The plans must hash the same in every
repeat (a wrapper changes no result).
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import importlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import bench_plan_time  # noqa: E402

from autopar.api import plan_traced, quiet_gc  # noqa: E402
from autopar.cost.cluster import get_cluster  # noqa: E402
from autopar.ir.options import PlanOptions  # noqa: E402
from autopar.solver.search import relaxation  # noqa: E402
from autopar.trace import trace_repeated  # noqa: E402

# (module, function or Class.method): the phases, from the outermost.
PHASES = (
    ("autopar.solver.planners.sharding", "solve_unexplained"),
    ("autopar.solver.problem.choices", "build_choice_graph"),
    ("autopar.solver.problem.ilp", "ShardingILP.__init__"),
    ("autopar.solver.search.solving", "solve_ilp"),
    ("autopar.solver.planners.sharding", "_solve_budgeted"),
    ("autopar.solver.planners.sharding", "_lean_start"),
    ("autopar.solver.search.lean", "lean_choice"),
    ("autopar.solver.search.budget", "trace_front"),
    ("autopar.solver.search.budget", "_dive"),
    ("autopar.solver.search.relaxation", "Relaxation.solve"),
    ("autopar.solver.search.relaxation", "Relaxation._run"),
    ("autopar.solver.search.relaxation", "Relaxation._sync"),
    ("autopar.solver.search.relaxation", "Relaxation._price"),
    ("autopar.solver.search.rounding", "round_relaxation"),
    ("autopar.solver.search.rounding", "check"),
    ("autopar.solver.problem.ilp", "ShardingILP.add_memory_constraint_at"),
    ("autopar.solver.planners.memory_plan", "plan_memory"),
    ("autopar.solver.planners.sharding", "_Priced.fixed"),
    ("autopar.solver.planners.sharding", "_with_memory_decisions"),
    ("autopar.solver.planners.sharding", "plan_from_solution"),
    ("autopar.solver.planners.sharding", "_with_memory"),
    ("autopar.solver.planners.sharding", "_explained"),
)


class Timers:
    """CPU seconds and calls per phase, and the LP solves (priced, iterations, seconds)."""

    def __init__(self):
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter = collections.Counter()
        self.solves: list[tuple[bool, int, float]] = []

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()
        self.solves.clear()

    def wrap(self, name: str, function):
        @functools.wraps(function)
        def timed(*args, **kwargs):
            start = time.process_time()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[name] += time.process_time() - start
                self.calls[name] += 1

        return timed

    def install(self) -> None:
        for module_name, attribute in PHASES:
            owner = importlib.import_module(module_name)
            *path, last = attribute.split(".")
            for part in path:
                owner = getattr(owner, part)
            original = getattr(owner, last)
            timed = self.wrap(attribute, original)
            setattr(owner, last, timed)
            if not path:  # a function imported by name elsewhere is called from there
                for module in list(sys.modules.values()):
                    if getattr(module, "__name__", "").startswith("autopar") and getattr(module, last, None) is original:
                        setattr(module, last, timed)
        run = relaxation.Relaxation._run

        def counted(model, time_limit_s):
            start = time.process_time()
            run(model, time_limit_s)
            self.solves.append((model.priced, model.highs.getInfo().simplex_iteration_count, time.process_time() - start))

        relaxation.Relaxation._run = counted


def profile_model(name: str, args: argparse.Namespace, timers: Timers) -> bool:
    """Print ``name``'s phases (module docstring); False where a plan changed between repeats."""
    cluster = get_cluster("h100-80g")
    model, model_args, kwargs, mesh = bench_plan_time.build(name, args.layers)
    with quiet_gc():
        traced = trace_repeated(model, model_args, kwargs)
    budget = None if args.default_budget else args.state_budget * bench_plan_time._state_bytes(model)
    options = {
        "unbounded": PlanOptions.from_keywords(memory_budget=float("inf")),
        "budgeted": PlanOptions.from_keywords(memory_budget=budget, offload=args.offload),
    }
    for value in options.values():  # warm-up, as bench_plan_time.py's
        plan_traced(traced, mesh, cluster, value)
    best: dict[str, dict[str, float]] = {label: {} for label in options}
    calls: dict[str, collections.Counter] = {}
    hashes: dict[str, set] = {label: set() for label in options}
    for _ in range(args.repeat):
        for label, value in options.items():
            gc.collect()
            timers.clear()
            start = time.process_time()
            plan = plan_traced(traced, mesh, cluster, value)
            seconds = {"plan_traced": time.process_time() - start, **timers.seconds}
            for phase, spent in seconds.items():
                best[label][phase] = min(best[label].get(phase, spent), spent)
            calls[label] = collections.Counter(timers.calls)
            hashes[label].add(plan.hash)
    print(f"{name}, {args.layers} layers, load {os.getloadavg()[0]:.1f}: CPU s, min of {args.repeat}; plans {hashes}")
    print(f"{'phase':40s} {'unbounded':>10s} {'budgeted':>10s} {'more':>8s}  calls")
    phases = set(best["unbounded"]) | set(best["budgeted"])
    for phase in sorted(phases, key=lambda p: best["budgeted"].get(p, 0.0) - best["unbounded"].get(p, 0.0), reverse=True):
        unbounded, budgeted = best["unbounded"].get(phase, 0.0), best["budgeted"].get(phase, 0.0)
        counts = f"{calls['unbounded'].get(phase, 0)} / {calls['budgeted'].get(phase, 0)}"
        print(f"{phase:40s} {unbounded:10.3f} {budgeted:10.3f} {budgeted - unbounded:8.3f}  {counts}")
    print("LP solves of the last budgeted plan (priced, simplex iterations, CPU s in HiGHS):")
    for priced, iterations, seconds in timers.solves:
        print(f"  {'priced' if priced else 'plain ':6s} {iterations:7d} {seconds:7.3f}")
    if any(len(h) > 1 for h in hashes.values()):
        print("plans differ between repeats (a time limit?)")
        return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt-oss"], choices=bench_plan_time.MODELS)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--state-budget", type=float, default=None, help="as bench_plan_time.py's")
    parser.add_argument("--default-budget", action="store_true", help="as bench_plan_time.py's")
    parser.add_argument("--offload", default="auto", choices=("auto", "off", "cpu", "disk"))
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if (args.state_budget is None) == (not args.default_budget):
        parser.error("give one of --state-budget F and --default-budget")
    timers = Timers()
    timers.install()
    for name in args.models:
        if not profile_model(name, args, timers):
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
