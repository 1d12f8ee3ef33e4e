"""Simplify the graph, solve the sharding ILP, and turn the solution into a Plan."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence

from autopar.cost import optimizer
from autopar.cost.cluster import ClusterSpec
from autopar.cost.comm import transition_bytes_per_axis
from autopar.errors import InfeasibleError
from autopar.ir.gathers import check_kept_layers
from autopar.ir.options import DEFAULT_OPTIMIZER, CommOptions, MixedPrecision, PlanOptions, to_dtype
from autopar.ir.plan import NodePlan, Plan
from autopar.ir.prediction import Prediction, SolverStats
from autopar.ir.spec import Spec, format_spec
from autopar.ir.summary import format_bytes
from autopar.solver.planners.data import batched_inputs, batched_outputs
from autopar.solver.planners.kept_layers import choose_kept, given_kept
from autopar.solver.planners.memory_plan import LayerPolicy, MemoryFigures, plan_memory
from autopar.solver.planners.settings import memory_budget
from autopar.solver.pricing.comm_schedule import ParamSchedule, param_schedule
from autopar.solver.pricing.reserved import allocator_budget, allocator_peaks, timeline_spans
from autopar.solver.pricing.runner_ups import explain_decisions
from autopar.solver.problem.choices import (
    ChoiceGraph,
    Offers,
    build_choice_graph,
    mesh_hint,
    optimizer_objective_s,
    param_sync_adjustment_s,
)
from autopar.solver.problem.fits import fits
from autopar.solver.problem.ilp import ShardingILP, Solution
from autopar.solver.problem.op_prices import expert_parallel_record, grad_sync_bytes_per_axis, pricing_for
from autopar.solver.search import backends
from autopar.solver.search.backends import check_solver
from autopar.solver.search.budget import solve_under_budget, trace_front
from autopar.solver.search.lean import lean_choice, least_peak
from autopar.solver.search.solving import (
    MAX_MEMORY_ROUNDS,
    chosen_bytes,
    edge_specs,
    peak_memory,
    solve_ilp,
    solve_within_budget,
)
from autopar.trace import TracedModel

log = logging.getLogger("autopar")

__all__ = ["solve", "solve_unexplained", "plan_from_solution", "predicted_step_s"]


def solve(
    traced: TracedModel,
    mesh_shape: Sequence[int],
    cluster: ClusterSpec,
    options: PlanOptions | None = None,
    *,
    forced: dict[str, Spec | str] | None = None,
    zero_stage: int = 0,
) -> Plan:
    """``solve_unexplained``'s plan with its decisions explained (``plan.decisions``)."""
    plan, explained = solve_unexplained(traced, mesh_shape, cluster, options, forced=forced, zero_stage=zero_stage)
    return explained(plan)


# Plans made again under a lower budget where the caching allocator would run out of the device
ALLOCATOR_ROUNDS = 4


def solve_unexplained(
    traced: TracedModel,
    mesh_shape: Sequence[int],
    cluster: ClusterSpec,
    options: PlanOptions | None = None,
    *,
    forced: dict[str, Spec | str] | None = None,
    zero_stage: int = 0,
) -> tuple[Plan, Callable[[Plan], Plan]]:
    """(plan, explained): the plan without its ``decisions``, and a function that gives a plan
    (this one, or one derived from it) those decisions, the runner-up of each choice
    (``solver.pricing.runner_ups``), which only a plan that is kept needs (a mesh search
    explains its chosen mesh alone). ``explained`` holds the choice graph while it lives.

    Plan ``traced`` on ``mesh_shape`` under ``options`` (``autopar.plan``'s, whole; None: its
    defaults), translated here once. ``options.solve.solver`` is "auto", "highs" or "cbc" (see
    ``solver.search.backends``); ``options.solve.time_limit_s`` bounds the solve, after which
    the best plan found (or a rounded / greedy fallback) is returned with its gap to the LP bound.

    The memory budget is ``options.memory.budget`` (None: the cluster's default, ``inf``: none).
    When the sharding does not fit it and checkpointing (allowed unless
    ``options.memory.checkpointing`` is False) or offload allows it,
    ``autopar.solver.planners.memory_plan`` adds checkpointing and offload decisions to the plan's
    ``memory`` (no sharding fitting at all, it starts from the leanest one).

    ``options.precision`` is the policy ``traced`` was traced under (``autopar.trace.trace``): the
    optimizer state is priced in the dtype the optimizer steps, its stored one (fp32 masters under
    "bf16-mixed"; the model's own under "32-true", as torch's AdamW keeps a bf16 model's moments
    in bf16), and the plan records the policy.
    ``options.comm`` is the communication schedule ``compile`` will run, as priced. ``forced``
    pins nodes' specs and ``zero_stage`` shards optimizer state and gradients (hand plans)."""
    settings = _Settings.of(options if options is not None else PlanOptions(), cluster, traced)
    if settings.comm is not None:
        check_kept_layers(settings.comm.reshard_after_forward, (i.fqn for i in traced.inputs if i.kind == "param"))
    budget_text = f", memory budget {format_bytes(settings.memory_budget)}" if settings.memory_budget else ", no memory budget"
    log.info("planning on mesh %s for cluster %s%s ...", tuple(mesh_shape), cluster.name, budget_text)
    start = time.perf_counter()
    log.info("autopar: rules and costs: pricing every node's strategies on mesh %s ...", tuple(mesh_shape))
    precision = settings.precision
    # The optimizer steps the stored parameters, so its state takes their dtype (None: the model's own)
    optimizer_dtype = to_dtype(precision.stored_dtype) if precision is not None else None
    # Priced as the cluster's executor runs the loss (``op_prices.pricing_for``): every planner
    # (``autopar.plan``, hand plans, Colossal-AI's, the mesh search) comes through here.
    with pricing_for(cluster):
        graph = build_choice_graph(
            traced,
            mesh_shape,
            cluster,
            forced=forced,
            zero_stage=zero_stage,
            optimizer_dtype=optimizer_dtype,
            comm=settings.comm,
            optimizer=settings.optimizer,
            offers=Offers(rows_out=settings.rows_out),
        )
        log.info(
            "autopar: rules and costs: %d nodes, %d edges in %.2f s (%d of %d op strategies cut: %d impossible, %d dominated)",
            len(graph.order),
            len(graph.edges),
            time.perf_counter() - start,
            graph.pruned.impossible + graph.pruned.dominated,
            graph.pruned.enumerated,
            graph.pruned.impossible,
            graph.pruned.dominated,
        )
        # when planning began, tracing included: what sizes the budgeted solve's second opinion
        began = start - traced.trace_s
        solution, plan, graph = _within_allocator(traced, graph, cluster, settings, forced, began)
    return (
        dataclasses.replace(plan, precision=precision, optimizer=settings.optimizer),
        functools.partial(_explained, graph, solution, cluster, settings.memory_budget),
    )


def _within_allocator(traced: TracedModel, graph: ChoiceGraph, cluster: ClusterSpec, settings: _Settings, forced, began: float):
    """``_plan_under`` ``settings``, then, while PyTorch's caching allocator would run out of the
    device for a plan whose tensors fit the budget, again under a lower budget
    (``pricing.reserved.allocator_budget``); an error where that does not end."""
    solution, plan, planned = _plan_under(traced, graph, cluster, settings, forced, began)
    asked = settings.memory_budget
    for _ in range(ALLOCATOR_ROUNDS):
        lowered = allocator_budget(plan, settings.memory_budget, asked)
        if lowered is None:
            return solution, plan, planned
        peaks = plan.predicted.allocator_peak_bytes
        log.warning(
            "autopar: the plan's tensors fit memory_budget=%s, but over a training step PyTorch's caching allocator "
            "would allocate %s (every block rounded up) and reserve %s (segments a freed block cannot leave while "
            "another in it lives), %s more than the device holds; planning again under %s",
            format_bytes(settings.memory_budget),
            format_bytes(peaks["allocated"]),
            format_bytes(peaks["reserved"]),
            format_bytes(peaks.get("short", 0)),
            format_bytes(lowered),
        )
        settings = dataclasses.replace(settings, memory_budget=lowered)
        solution, plan, planned = _plan_under(traced, graph, cluster, settings, forced, began)
    if allocator_budget(plan, settings.memory_budget) is not None:
        raise InfeasibleError(
            f"the plan's tensors fit memory_budget={settings.memory_budget:.0f} bytes after {ALLOCATOR_ROUNDS} lower "
            f"budgets, but PyTorch's caching allocator would still run out of the device's {cluster.memory_bytes} bytes "
            f"(its peaks: {dict(plan.predicted.allocator_peak_bytes)}).\n  Lower memory_budget, or plan on a larger mesh."
        )
    return solution, plan, planned


def _plan_under(traced: TracedModel, graph: ChoiceGraph, cluster: ClusterSpec, settings: _Settings, forced, began: float):
    """(solution, plan, the graph as priced for its schedule) of ``graph`` under ``settings``:
    the sharding, then its memory decisions, or else the layers it keeps gathered
    (``began``: when planning began, tracing included)."""
    priced = _Priced(traced, graph, cluster, settings)
    solved = _solve_sharding(graph, settings, forced, began, priced)
    solution, parts, memory = _with_memory_decisions(traced, graph, cluster, settings, solved, priced)
    kept = given_kept(graph, solution)  # the schedule priced, for compile to run it
    chosen = None
    if memory is None and graph.comm.reshard_after_forward == "auto":
        chosen = _with_kept_layers(traced, graph, solution, cluster, settings, parts)
    if chosen is not None:
        plan, graph, kept = chosen
    else:  # the allocator is simulated on the plan's final walk: with memory decisions, their walk's
        plan = plan_from_solution(traced, graph, solution, cluster, settings.memory_budget, parts, allocator=memory is None)
    if memory is not None:
        plan = _with_memory(plan, *memory)
    return solution, dataclasses.replace(plan, kept_layers=kept), graph


def _with_kept_layers(
    traced: TracedModel, graph: ChoiceGraph, solution: Solution, cluster: ClusterSpec, settings: _Settings, parts: _StepParts
) -> tuple[Plan, ChoiceGraph, tuple[str, ...]] | None:
    """(plan, its graph, the layers it keeps) of ``solution`` with the layers kept gathered that
    the budget holds (``kept_layers.choose_kept``), and PyTorch's caching allocator too: where it
    would run out of the device, fewer, under the lower budget it asks for, without solving again
    (``_within_allocator`` does where even FSDP2's default would); None where none is worth it."""

    def step_of(other: ChoiceGraph) -> _StepParts:
        return _StepParts.of(other, solution, cluster)

    budget = settings.memory_budget
    for _ in range(ALLOCATOR_ROUNDS):
        chosen = choose_kept(graph, solution, cluster, budget, parts, step_of)
        if chosen is None:
            return None
        kept_graph, kept, kept_parts = chosen
        plan = plan_from_solution(traced, kept_graph, solution, cluster, settings.memory_budget, kept_parts)
        budget = allocator_budget(plan, budget, settings.memory_budget)
        if budget is None:
            return plan, kept_graph, kept
    return None


def _explained(graph: ChoiceGraph, solution: Solution, cluster: ClusterSpec, memory_budget: float | None, plan: Plan) -> Plan:
    start = time.perf_counter()
    with pricing_for(cluster):  # priced as the plan was (``solve_unexplained``)
        decisions = explain_decisions(graph, solution, cluster, memory_budget)
    log.info("autopar: explanations of %d decisions in %.2f s", len(decisions), time.perf_counter() - start)
    return dataclasses.replace(plan, decisions=decisions)


@dataclasses.dataclass(frozen=True, slots=True)
class _Settings:
    """``PlanOptions`` as the sharding planner reads them, translated once (``of``)."""

    memory_budget: float | None  # bytes per device; None: no budget
    offload: str | None  # the offload target, "cpu" or "disk"; None: no offload
    checkpointing: bool
    prefetch: bool
    time_limit_s: float
    solver: str
    budget_gap: float  # a budgeted plan this close to the LP bound needs no MILP (SolveOptions)
    precision: MixedPrecision | None
    comm: CommOptions | None
    # A checkpoint policy layers take whatever the budget ("selective", "selective-op", "full": every layer, or
    # those of the modules the model checkpoints itself); None: the memory planner chooses per layer where the
    # budget binds.
    policy: LayerPolicy | None = None
    optimizer: str = DEFAULT_OPTIMIZER  # the one the step is priced for (``PlanOptions.optimizer``)
    # The outputs that leave split, each rank its rows (``batch="per_rank"``'s batched outputs): no gather priced
    rows_out: frozenset[str] = frozenset()

    @classmethod
    def of(cls, options: PlanOptions, cluster: ClusterSpec, traced: TracedModel) -> _Settings:
        """``options`` on ``cluster``. Where they leave checkpointing to the planner (None) and the
        model checkpoints activations itself (``TracedModel.checkpointing``, ``trace.checkpoints``),
        the model's policy, on the layers it checkpoints."""
        memory = options.memory
        offload, _ = memory.offload_target(has_host=cluster.host_link is not None)
        # Checkpointing moves no data off the device: allowed by default, used only where the budget binds.
        checkpointing = True if memory.checkpointing is None else bool(memory.checkpointing)
        policy = LayerPolicy(memory.checkpointing) if isinstance(memory.checkpointing, str) else None
        if memory.checkpointing is None and traced.checkpointing is not None:
            policy = LayerPolicy(traced.checkpointing, traced.checkpointed)
        return cls(
            memory_budget(options, cluster),
            offload,
            checkpointing,
            memory.prefetch,
            options.solve.time_limit_s,
            check_solver(options.solve.solver),
            options.solve.budget_gap,
            options.precision,
            options.comm,
            policy,
            options.optimizer,
            frozenset(batched_outputs(traced, batched_inputs(traced))) if options.data.per_rank else frozenset(),
        )

    @property
    def decides_memory(self) -> bool:
        """Whether the memory planner may add checkpointing or offload where the budget binds."""
        return bool(self.checkpointing or self.offload)


@dataclasses.dataclass(frozen=True, slots=True)
class _Solved:
    """The sharding ``_solve_sharding`` found (``solution``), the fastest one with no budget
    (``unbounded``), the Lagrangian plans on the way to the budget (``visited``), and their ILP."""

    ilp: ShardingILP
    solution: Solution
    unbounded: Solution
    visited: list[dict[str, int]]


def _solve_sharding(
    graph: ChoiceGraph, settings: _Settings, forced: dict[str, Spec | str] | None, began: float, priced: _Priced | None = None
) -> _Solved:
    """The fastest sharding within the budget (``began``: when planning began); the leanest one
    where none fits and the memory planner may shrink it; else an error that says why.
    ``priced``: where the Lagrangian front may price its plans' memory decisions as it goes."""
    memory_budget, time_limit_s, solver = settings.memory_budget, settings.time_limit_s, settings.solver
    log.info("autopar: solving the ILP ...")
    deadline = time.perf_counter() + time_limit_s
    ilp = ShardingILP(graph, None)
    solution = unbounded = solve_ilp(ilp, time_limit_s, solver)
    visited: list[dict[str, int]] = []  # the Lagrangian plans on the way to the budget
    if memory_budget is not None and solution.choice and not fits(peak_memory(graph, solution).bytes, memory_budget):
        floor = least_peak(graph) if settings.decides_memory else None
        if floor is not None and not fits(floor, memory_budget):
            solution = _lean_start(ilp, memory_budget, floor, unbounded, deadline, solver, visited, priced)
        else:
            solution = _solve_budgeted(ilp, memory_budget, unbounded, deadline, solver, visited, began, settings.budget_gap)
    log.info("autopar: solve: %s in %.2f s", solution.status, solution.solve_time_s)
    if not solution.choice:
        # No sharding fits alone: with checkpointing or offload allowed, start from the leanest
        # one (forced specs included) and let the memory planner bring it under the budget.
        can_shrink = memory_budget is not None and settings.decides_memory
        if can_shrink:
            solution = _leanest(graph, time_limit_s, solver)
        if not solution.choice and forced and not unbounded.choice:  # (with one, the budget is the cause)
            named = [f"{k}: {v if isinstance(v, str) else format_spec(v)}" for k, v in forced.items()]
            raise InfeasibleError(
                f"no plan satisfies the forced specs ({', '.join(named[:6])}{f' and {len(named) - 6} more' if len(named) > 6 else ''})"
                ": they need a resharding that does not exist (into Partial, or of a tensor written in place)"
            )
        if not solution.choice and memory_budget is not None and not can_shrink:
            raise _infeasible(graph, memory_budget, time_limit_s, solver, bool(forced))
        if not solution.choice:
            raise InfeasibleError(f"the sharding ILP found no solution ({solution.status}); this is a bug in autopar")
    return _Solved(ilp, solution, unbounded, visited)


def _memory_for(
    traced: TracedModel, graph: ChoiceGraph, cluster: ClusterSpec, settings: _Settings, candidate: Solution, explain: bool = True
):
    """``plan_memory``'s (decisions, figures) for a sharding over the budget; None for one
    that fits as it is (or when nothing may be checkpointed or offloaded)."""
    if settings.policy is None and (settings.memory_budget is None or not settings.decides_memory):
        return None
    if settings.policy is None and fits(peak_memory(graph, candidate).bytes, settings.memory_budget):
        return None
    return plan_memory(
        traced,
        graph,
        candidate.choice,
        cluster,
        settings.memory_budget if settings.memory_budget is not None else math.inf,
        target=settings.offload,
        prefetch=settings.prefetch,
        checkpointing=settings.checkpointing,
        explain=explain,
        policy=settings.policy,
    )


def _with_memory_decisions(
    traced: TracedModel,
    graph: ChoiceGraph,
    cluster: ClusterSpec,
    settings: _Settings,
    solved: _Solved,
    priced: _Priced | None = None,
):
    """(solution, its ``_StepParts``, its memory decisions or None): which sharding, with which
    memory decisions, is decided first, and its plan built once after (a candidate that wins
    later would make an earlier plan waste). ``priced``: what the solve priced already.

    A sharding whose step before memory decisions is within ``settings.budget_gap`` of the best
    plan so far is not given memory decisions (``_could_win``): they only add time, so it could
    beat that plan by no more than the gap the budgeted search accepts from its LP bound. (On the
    zoo Llama at 48 layers that skips three ``plan_memory`` calls for a plan 0.25% faster.)"""
    if priced is None:
        priced = _Priced(traced, graph, cluster, settings)
    solution, unbounded = solved.solution, solved.unbounded
    parts = _StepParts.of(graph, solution, cluster)
    alone = solution is unbounded or not unbounded.choice or not settings.decides_memory
    try:
        memory = priced.memory(solution)
    except InfeasibleError as error:
        # The leanest sharding, with a fixed checkpoint policy, can peak where a faster one
        # does not (its resharding temporaries): try the others before failing.
        if alone:
            raise
        failed, memory = error, None
        step_s = math.inf
    else:
        failed = None
        step_s = parts.step_s + (memory[0].added_s if memory is not None else 0.0)  # the plan's predicted step
    if alone:
        return solution, parts, memory
    # A faster sharding with checkpointing (or offload) may beat the leaner one that fits
    # alone: try the fastest and the Lagrangian plans on the way to the budget.
    for choice in _spread([unbounded.choice] + solved.visited, _MAX_MEMORY_CANDIDATES):
        if choice == solution.choice:
            continue
        fixed = priced.fixed(solved.ilp, choice, unbounded)
        if fixed is None:
            continue
        other_solution, other_parts = fixed
        # checkpointing and offload only add time, so this bounds the sharding's step with them
        # from below (``_lower_s``): one that can win back no more than ``budget_gap`` is skipped
        if not _could_win(_lower_s(other_solution, other_parts, cluster), step_s, settings.budget_gap):
            continue
        try:
            other_memory = priced.memory(other_solution, explain=False)
        except InfeasibleError:
            continue
        if other_memory is None:  # a Lagrangian plan that fits as it is
            other_solution = dataclasses.replace(other_solution, status="Feasible (lagrangian)")
            other_parts = dataclasses.replace(other_parts, solution=other_solution)
        added_s = other_memory[0].added_s if other_memory is not None else 0.0
        if other_parts.step_s + added_s < step_s:
            solution, parts, memory = other_solution, other_parts, other_memory
            step_s = parts.step_s + added_s
    if failed is not None and step_s == math.inf:
        raise failed
    return solution, parts, memory


# The second-opinion MILP under a budget (``_solve_budgeted``) gets this share of the time planning
# has taken so far, tracing included, and at least ``_MIN_MILP_S``. (HF LLaMA-2-70B at 128 × 4096 on
# (128, 8): 10 s to plan unbounded, and the MILP's plan, 0.5% faster than the Lagrangian one, found
# after 2.7 s; the golden ``checkpointing_budget``, 4% faster, proven optimal in 1.4 s.)
_MILP_SHARE = 0.3
_MIN_MILP_S = 2.0
# Shardings that ``solve`` tries with checkpointing or offload under a binding budget.
_MAX_MEMORY_CANDIDATES = 6


def _spread(items: list, count: int) -> list:
    """At most ``count`` of ``items``, evenly spread, the first and last kept."""
    if len(items) <= count:
        return items
    step = (len(items) - 1) / (count - 1)
    return [items[round(i * step)] for i in range(count)]


class _Priced:
    """The memory decisions (``_memory_for``) and fixed solutions (``_fixed_solution``, with their
    ``_StepParts``) of the shardings ``solve`` weighs under a binding budget, each priced once:
    the Lagrangian front prices its plans as it goes (``_front_stop``), ``_with_memory_decisions``
    after, from here. A sharding is keyed by its strategies in graph order."""

    def __init__(self, traced: TracedModel, graph: ChoiceGraph, cluster: ClusterSpec, settings: _Settings):
        self.traced, self.graph, self.cluster, self.settings = traced, graph, cluster, settings
        self._memory: dict = {}
        self._fixed: dict = {}

    def _key(self, choice: dict[str, int]) -> tuple[int, ...]:
        return tuple(choice[name] for name in self.graph.order)

    def memory(self, solution: Solution, explain: bool = True):
        """``_memory_for(solution)``: raises its InfeasibleError again when asked again."""
        key = (self._key(solution.choice), explain)
        if key not in self._memory:
            try:
                self._memory[key] = _memory_for(self.traced, self.graph, self.cluster, self.settings, solution, explain)
            except InfeasibleError as error:
                self._memory[key] = error
        value = self._memory[key]
        if isinstance(value, InfeasibleError):
            raise value
        return value

    def fixed(self, ilp: ShardingILP, choice: dict[str, int], like: Solution) -> tuple[Solution, _StepParts] | None:
        """``_fixed_solution(ilp, choice, like)`` and its ``_StepParts``; None where it is None."""
        key = self._key(choice)
        if key not in self._fixed:
            fixed = _fixed_solution(ilp, choice, like)
            self._fixed[key] = None if fixed is None else (fixed[0], _StepParts.of(self.graph, fixed[0], self.cluster, fixed[1]))
        return self._fixed[key]


def _front_stop(
    priced: _Priced, ilp: ShardingILP, lean: Solution | None, unbounded: Solution
) -> Callable[[dict[str, int]], bool]:
    """``trace_front``'s ``stop``: weighs each plan of the front as ``_with_memory_decisions`` will
    (after the leanest plan and the fastest, in the front's order) and says True once no later
    plan of the front can beat the best plan so far, with its memory decisions, by more than
    ``budget_gap`` (``SolveOptions``; 0: by anything).

    Why no bound from the LP: a Lagrangian point at price λ bounds the sharding alone,
    ``min_x time(x) + λ·(M x - B) ≤ time(x*)``, but here no sharding fits the budget ``B`` alone
    (``lean.least_peak`` is over it), so that bound grows without end in λ: it bounds an empty
    problem. The plans are brought under ``B`` by checkpointing and offload, which the LP does not
    model, and offload hidden behind compute adds 0 s: the one sound bound on the whole problem is
    the unbounded plan's step (on a tiny GPT-OSS 20× under the plan kept). What the front gives
    instead is a bound on its later points: point k minimises ``time + f_k·price·M`` and f rises,
    so a later optimum has no less time (exchange the two optimality conditions: ``(f_j - f_k)(M_j
    - M_k) ≤ 0``, then ``time_j ≥ time_k``); the rounded plans and their predicted steps follow
    the LP's optima, which is assumed, not proved. And a later point peaks at least at the least
    peak, so its memory decisions must save at least what the leanest plan's save: they are taken
    to cost at least the least any plan priced so far paid (assumed too; the leanest plan's
    usually). So the front stops where ``step_k + that least`` is within ``budget_gap`` of the
    best plan (``_could_win``); benchmarks/README.md (bench_plan_time) has the plans this changes.
    On a tiny GPT-OSS the fourth LP of the front is gone, the plan kept the same. (Where the whole
    front would hold more plans than ``_MAX_MEMORY_CANDIDATES``, ``_spread`` picks among fewer.)"""
    gap = priced.settings.budget_gap
    best, least_added = math.inf, math.inf

    def weigh(solution: Solution, parts: _StepParts | None = None, explain: bool = False) -> None:
        nonlocal best, least_added
        try:
            memory = priced.memory(solution, explain=explain)
        except InfeasibleError:
            return
        added = memory[0].added_s if memory is not None else 0.0
        parts = parts or _StepParts.of(priced.graph, solution, priced.cluster)
        best, least_added = min(best, parts.step_s + added), min(least_added, added)

    if lean is not None:
        weigh(lean, explain=True)

    def done(choice: dict[str, int]) -> bool:
        if lean is not None and choice == lean.choice:
            return False
        fixed = priced.fixed(ilp, choice, unbounded)
        if fixed is None:
            return False
        lower = _lower_s(*fixed, priced.cluster)
        if _could_win(lower, best, gap):  # as ``_with_memory_decisions`` weighs it
            weigh(*fixed)
        return not _could_win(lower + _finite_or_zero(least_added), best, gap)  # the later points

    done(unbounded.choice)
    return done


def _lower_s(solution: Solution, parts: _StepParts, cluster: ClusterSpec) -> float:
    """A lower bound on the predicted step of ``solution`` with any memory decisions, which only
    add time: its step; on gloo its objective, which prices the gathers whole (on NCCL clusters
    they overlap compute, ``ParamSchedule.overlaps``, and the step may be under the objective)."""
    return solution.objective_s if cluster.gloo else parts.step_s


def _could_win(lower_s: float, best_s: float, gap: float) -> bool:
    """Whether a plan whose step is at least ``lower_s`` could beat ``best_s`` by more than the
    fraction ``gap`` (``SolveOptions.budget_gap``; 0: by anything)."""
    return not math.isfinite(best_s) or lower_s < best_s * (1.0 - gap)


def _finite_or_zero(seconds: float) -> float:
    return seconds if math.isfinite(seconds) else 0.0


def _fixed_solution(ilp: ShardingILP, choice: dict[str, int], like: Solution) -> tuple[Solution, tuple[float, float]] | None:
    """A Solution of ``choice`` (which need not fit the budget), for ``plan_from_solution``, and
    its ``_compute_and_reshard_s`` (which its objective starts from, and its step too); None
    where ``choice`` needs a resharding that does not exist (into Partial): a rounded
    Lagrangian plan (``solved.visited``) is kept before its rows are checked."""
    specs = edge_specs(ilp.graph, choice)
    sums = _compute_and_reshard_s(ilp.graph, choice, specs, missing_ok=True)
    if sums is None:
        return None
    objective = sums[0] + sums[1]
    objective += param_sync_adjustment_s(ilp.graph, choice)  # as the ILP prices it: reductions once, bucketed
    objective += optimizer_objective_s(ilp.graph, choice)  # and the optimizer step of each parameter's placement
    objective += _overlap_s(ilp.graph, choice, specs)  # and the communication the runtime overlaps
    return dataclasses.replace(
        like,
        choice=choice,
        edge_specs=specs,
        objective_s=objective,
        status="Feasible (with memory decisions)",
        method="lagrangian",
        gap=None,
        bound_s=None,
    ), sums


def _overlap_s(graph: ChoiceGraph, choice: Mapping[str, int], specs: dict[int, tuple[Spec, Spec]]) -> float:
    """What the ILP's objective holds for ``choice`` in place of its gathers' and gradient
    reductions' whole prices, where the runtime overlaps them (``gather_overlap``; 0 elsewhere)."""
    if graph.overlap is None:
        return 0.0
    groups, _ = graph.param_sync_groups()
    # the reductions' seconds that backward may hide (the last bucket's are paid whole, as the ILP pays them)
    return graph.overlap.adjustment_s(specs, graph.overlap.hidden_sync_s(groups, choice))


def _compute_and_reshard_s(
    graph: ChoiceGraph, choice: dict[str, int], specs: dict[int, tuple[Spec, Spec]], missing_ok: bool = False
) -> tuple[float, float] | None:
    """(Σ compute seconds of the chosen strategies, in graph order; Σ seconds of the edges'
    reshardings, in edge order): the sums that the objective of a fixed plan, ``predicted_step_s``
    and ``plan_from_solution`` all start from, added in one order so that they agree exactly.
    ``missing_ok``: None where a resharding does not exist (else a KeyError)."""
    compute_s = reshard_s = 0.0
    for name in graph.order:
        compute_s += graph.choices[name].priced[choice[name]].compute_s
    for e, edge in enumerate(graph.edges):
        src, dst = specs[e]
        if src != dst:
            price = edge.price.get((src, dst))
            if price is None:
                if missing_ok:
                    return None
                raise KeyError((src, dst))
            reshard_s += price[0]
    return compute_s, reshard_s


def _solve_budgeted(
    ilp: ShardingILP,
    memory_budget: float,
    unbounded: Solution,
    deadline: float,
    solver: str,
    visited: list[dict[str, int]],
    began: float,
    gap: float,
) -> Solution:
    """The fastest plan does not fit: the Lagrangian fast path (``solver.search.budget``); the MILP
    with its memory cutting-plane loop only for ``solver="highs"`` or ``"cbc"``, or while a gap
    above ``gap`` (``SolveOptions.budget_gap``) remains (the better of the two is kept).

    Under ``solver="auto"`` that MILP is a second opinion, not the answer: it gets
    ``_MILP_SHARE`` of the time planning has taken so far (``began``: tracing included), at
    least ``_MIN_MILP_S``, so that a binding budget costs about a third more than the unbounded
    plan, not ``time_limit_s``. (The gap is to the LP bound with memory rows, which is loose: on
    deep LLaMAs the MILP ran to its 60 s limit and the Lagrangian plan, checkpointed, won anyway.)"""
    ilp.add_memory_constraint(memory_budget)
    fast = None
    if solver == "auto":
        fast = solve_under_budget(ilp, memory_budget, max(deadline - time.perf_counter(), 1.0), unbounded, visited)
        if fast.choice and (fast.gap or 0.0) <= gap or fast.status == "Infeasible":
            return fast  # close enough; or even the LP relaxation does not fit: neither will the MILP
    left = deadline - time.perf_counter()
    if fast is not None and fast.choice:
        left = min(left, max(_MIN_MILP_S, _MILP_SHARE * (time.perf_counter() - began)))
        if left < 1.0:
            return fast
        log.info(
            "autopar: the fast plan is %.1f%% from the LP bound (over budget_gap=%g): the MILP looks for a better "
            "one for up to %.1f s (budget_gap=1 skips it)",
            100 * (fast.gap or 0.0),
            gap,
            left,
        )
    exact, fitting = solve_within_budget(ilp, memory_budget, max(left, 1.0), backends.mip_backend(solver))
    if not fitting:
        log.warning(
            "autopar: after up to %d memory rounds (or the time limit) the plan still peaks at %.0f bytes, over memory_budget=%.0f",
            MAX_MEMORY_ROUNDS,
            peak_memory(ilp.graph, exact).bytes,
            memory_budget,
        )
        exact = dataclasses.replace(exact, choice={}, status="Infeasible (memory rounds)")
    if fast is not None and fast.choice and (not exact.choice or fast.objective_s <= exact.objective_s):
        return fast
    return exact


def _lean_start(
    ilp: ShardingILP,
    memory_budget: float,
    floor: float,
    unbounded: Solution,
    deadline: float,
    solver: str,
    visited: list[dict[str, int]],
    priced: _Priced | None = None,
) -> Solution:
    """No sharding fits ``memory_budget`` alone (``floor``, ``lean.least_peak``, is over it): the leanest
    sharding, for the memory planner to bring under the budget, and (``solver="auto"``) the
    Lagrangian plans on the way to it in ``visited``, which may do better with checkpointing
    (``priced``: the front stops at one that cannot, ``_front_stop``). Built where it can be
    proved leanest (``lean.lean_choice``); else the min-peak MILP."""
    lean = lean_choice(ilp, floor)  # before the memory rows, which it would not meet
    solution = None
    if lean is not None:
        fixed = _fixed_solution(ilp, lean, unbounded)
        assert fixed is not None, "lean_choice passed rounding.check: every resharding exists"
        solution = dataclasses.replace(fixed[0], status="Optimal (leanest)", method="leanest")
    ilp.add_memory_constraint(memory_budget)
    if solver == "auto":
        stop = _front_stop(priced, ilp, solution, unbounded) if priced is not None else None
        trace_front(ilp, memory_budget, max(deadline - time.perf_counter(), 1.0), unbounded, visited, floor, stop)
    if solution is None:
        return _leanest(ilp.graph, max(deadline - time.perf_counter(), 1.0), solver)
    return solution


def _leanest(graph: ChoiceGraph, time_limit_s: float, solver: str) -> Solution:
    """The sharding of least peak memory."""
    lean = ShardingILP(graph, None)
    lean.minimize_peak_memory(graph.timeline.checkpoints([graph.bytes_bound(largest=False)]))
    # The LP-rounding fast path prices x and y only; this objective is an extra peak variable.
    return solve_ilp(lean, time_limit_s, backends.mip_backend(solver))


def _with_memory(plan: Plan, memory, figures: MemoryFigures) -> Plan:
    """``plan`` with the memory decisions ``plan_memory`` made for its sharding: its peak, what
    is alive there, the allocator's peaks and the sampled timeline all under them."""
    predicted = dataclasses.replace(
        plan.predicted,
        step_time_s=plan.predicted.step_time_s + memory.added_s,
        memory_s=memory.added_s,
        peak_memory_bytes=int(memory.peak_bytes),
        peak_memory_at=figures.time,
        memory_at_peak_bytes={k: int(v) for k, v in figures.at_peak.items()},
        allocator_peak_bytes=figures.allocator(),
    )
    return dataclasses.replace(plan, memory=memory, predicted=predicted, memory_timeline=figures.timeline())


def _infeasible(graph: ChoiceGraph, budget: float, time_limit_s: float, solver: str, forced: bool = False) -> InfeasibleError:
    """Say how much memory the leanest plan needs (``forced``: under the forced specs, a hand
    plan's layout), and which tensors weigh most."""
    solution = _leanest(graph, time_limit_s, solver)
    minimum = peak_memory(graph, solution).bytes if solution.choice else float("nan")
    biggest = sorted(
        ((max(c.priced.memory_bytes), c.fqn or c.name) for c in graph.choices.values() if c.priced),
        reverse=True,
    )[:5]
    lines = "\n".join(f"    {name}: {format_bytes(size)} replicated" for size, name in biggest)
    lines += mesh_hint(graph, [name for _, name in biggest])
    return InfeasibleError(
        f"no sharding of this model{' with its forced specs (a hand plan layout)' if forced else ''} fits "
        f"memory_budget={budget:.0f} bytes ({format_bytes(budget)}) per device "
        f"on mesh {graph.mesh_shape}.\n  The leanest plan needs {minimum:.0f} bytes ({format_bytes(minimum)}) "
        f"per device (parameters, gradients, optimizer state and what its step holds, saved activations).\n"
        f"  Largest tensors:\n{lines}\n"
        "  Raise the budget (float('inf') plans without one), use a larger mesh, a smaller batch or sequence, or "
        "precision='bf16-mixed'; or let the planner add activation checkpointing and offload: "
        'autopar.plan(..., offload="auto") (or checkpointing=True alone), `autopar plan ... --offload auto` '
        "on the command line."
    )


def predicted_step_s(graph: ChoiceGraph, solution: Solution, cluster: ClusterSpec) -> float:
    """``plan_from_solution(...).predicted.step_time_s``, summed in the same order, without the
    plan: what ``solve`` compares its memory candidates by (``_StepParts.step_s``)."""
    return _StepParts.of(graph, solution, cluster).step_s


@dataclasses.dataclass(frozen=True, slots=True)
class _StepParts:
    """What a plan's predicted step is summed from (``_compute_and_reshard_s`` and the parameter
    schedule), for ``predicted_step_s`` and ``plan_from_solution``: a candidate that wins is not
    priced twice."""

    solution: Solution
    compute_s: float
    reshard_s: float
    schedule: ParamSchedule
    optimizer_s: float = 0.0  # the AdamW step after backward (``cost.optimizer``)

    @classmethod
    def of(
        cls, graph: ChoiceGraph, solution: Solution, cluster: ClusterSpec, sums: tuple[float, float] | None = None
    ) -> _StepParts:
        """``sums``: the solution's ``_compute_and_reshard_s``, where the caller has it already."""
        compute_s, reshard_s = sums or _compute_and_reshard_s(graph, solution.choice, solution.edge_specs)
        schedule = param_schedule(graph, solution.choice, cluster)
        stepped = optimizer.stepped_tensors(graph.timeline.intervals, graph.bytes_of(solution.choice))
        params = [
            choice.strategies[solution.choice[name]].outs[0] for name, choice in graph.choices.items() if choice.kind == "param"
        ]
        dtensors = optimizer.holds_dtensors(params)
        optimizer_s = optimizer.plan_step_s(stepped, cluster, graph.mesh_shape, dtensors, graph.optimizer)
        return cls(solution, compute_s, reshard_s, schedule, optimizer_s)

    @property
    def step_s(self) -> float:
        schedule = self.schedule
        step = self.compute_s + self.reshard_s + schedule.delta_s - schedule.sync_s + schedule.exposed_s + self.optimizer_s
        if schedule.overlaps:  # FSDP's gathers priced whole above; only what compute does not hide counts
            step += schedule.overlap_delta_s
        return step


def plan_from_solution(
    traced: TracedModel,
    graph: ChoiceGraph,
    solution: Solution,
    cluster: ClusterSpec,
    memory_budget: float | None,
    parts: _StepParts | None = None,
    allocator: bool = True,
) -> Plan:
    """The plan of ``solution``. ``parts``: its step's sums, where the caller has them already;
    ``allocator``: with the caching allocator's peaks (``pricing.reserved``)."""
    if parts is None or parts.solution is not solution:
        parts = _StepParts.of(graph, solution, cluster)
    nodes, params, traffic, expert_parallel = _node_plans(graph, solution, cluster)
    for fqn, canonical in traced.ties.items():
        if canonical in params and fqn not in params:
            params[fqn] = params[canonical]
        assert params.get(fqn) == params.get(canonical), f"tied {fqn} and {canonical} planned apart"
    _add_resharding_traffic(graph, solution, traffic)
    # As the runtime schedules parameter communication (``passes.schedule``): one reduction and
    # one gather per parameter, FSDP's reduce-scatter, and only the exposed part of the buckets.
    traffic.add(parts.schedule.delta_bytes, parts.schedule.delta_bytes_per_axis)
    chosen = chosen_bytes(graph, solution)
    predicted = _predicted(graph, parts, traffic, chosen, expert_parallel or None, cluster if allocator else None)
    solver_info = SolverStats(
        status=solution.status,
        objective_s=solution.objective_s,
        num_variables=solution.num_variables,
        num_constraints=solution.num_constraints,
        memory_budget_bytes=memory_budget,
        fallbacks=tuple(sorted(n for n, p in nodes.items() if p.source == "fallback")),
        method=solution.method,
        backend=solution.backend,
        lower_bound_s=solution.bound_s,
        gap=solution.gap,
    )
    log.debug("solved: %s in %.3f s", solver_info.status, solution.solve_time_s)
    return Plan(
        mesh_shape=tuple(graph.mesh_shape),
        graph_hash=traced.graph_hash,
        params=params,
        nodes=nodes,
        predicted=predicted,
        solver=solver_info,
        cluster=cluster.name,
        memory_timeline=graph.timeline.sampled(chosen),
        input_dtypes={
            node.name: str(node.meta["val"].dtype)
            for node in traced.gm.graph.nodes
            if node.op == "placeholder" and hasattr(node.meta.get("val"), "dtype")
        },
        stats={"solve_time_s": solution.solve_time_s, "strategies": graph.pruned.as_dict()},
    )


@dataclasses.dataclass(slots=True)
class _Traffic:
    """Bytes each device sends in a step, in all (``comm_bytes``) and on each mesh axis, summed
    as the plan is read (node by node, then edge by edge, then the parameter schedule)."""

    comm_bytes: float
    per_axis: list[float]

    def add(self, sent: float, per_axis: dict[int, float]) -> None:
        self.comm_bytes += sent
        for axis, axis_sent in per_axis.items():
            self.per_axis[axis] += axis_sent


def _node_plans(
    graph: ChoiceGraph, solution: Solution, cluster: ClusterSpec
) -> tuple[dict[str, NodePlan], dict[str, Spec], _Traffic, list]:
    """(node name -> NodePlan, parameter FQN -> spec, the gradient reductions' traffic, the
    expert-parallel records) of ``solution``."""
    nodes: dict[str, NodePlan] = {}
    params: dict[str, Spec] = {}
    traffic = _Traffic(0.0, [0.0] * len(graph.mesh_shape))
    expert_parallel = []
    for name in graph.order:
        choice = graph.choices[name]
        index = solution.choice[name]
        priced = choice.priced[index]
        strategy = priced.strategy
        record = expert_parallel_record(choice, index, graph.mesh_shape, cluster)
        if record is not None:
            expert_parallel.append(record)
        op = str(choice.info.target) if choice.info is not None else ("getitem" if strategy.source == "follow" else choice.kind)
        nodes[name] = NodePlan(
            op=op,
            outs=strategy.outs,
            ins=strategy.ins,
            inputs=tuple(choice.inputs),
            shapes=choice.out_shapes,
            kernel=strategy.kernel,
            kernel_axes=strategy.kernel_axes,
            source=strategy.source,
            cost_s=priced.compute_s,
            whole_grad=strategy.whole_grad,
        )
        traffic.add(priced.grad_sync_bytes, grad_sync_bytes_per_axis(choice, index, graph.choices, graph.mesh_shape))
        if choice.kind in ("param", "buffer") and choice.fqn is not None and strategy.outs:
            params[choice.fqn] = strategy.outs[0]
    return nodes, params, traffic, expert_parallel


def _add_resharding_traffic(graph: ChoiceGraph, solution: Solution, traffic: _Traffic) -> None:
    """Add the bytes of every edge whose ends differ in spec to ``traffic``."""
    for e, edge in enumerate(graph.edges):
        src, dst = solution.edge_specs[e]
        if src != dst:
            traffic.add(
                edge.price[(src, dst)][1],
                transition_bytes_per_axis(
                    src, dst, edge.shape, edge.dtype, graph.mesh_shape, edge.requires_grad, edge.grad_dtype
                ),
            )


def _overlap_terms(schedule: ParamSchedule) -> dict[str, float]:
    """The overlapped gathers' terms of ``grad_schedule`` (``comm_schedule.ParamSchedule``), where any overlap."""
    if not schedule.overlaps:
        return {}
    names = ("gather_s", "regather_s", "gathered_s", "first_gather_s", "regathered_s", "forward_s", "copy_s")
    return {name: getattr(schedule, name) for name in names}


def _predicted(
    graph: ChoiceGraph, parts: _StepParts, traffic: _Traffic, chosen, expert_parallel, cluster: ClusterSpec | None
) -> Prediction:
    """The plan's ``predicted`` section (with the caching allocator's peaks on ``cluster``; None: without)."""
    schedule, choice = parts.schedule, parts.solution.choice
    peak_bytes, peak_time = graph.timeline.peak(chosen)
    return Prediction(
        step_time_s=parts.step_s,
        # The per-use parameter all-reduces in the choices' compute_s are in grad_sync_s (bucketed).
        compute_s=parts.compute_s - schedule.per_use_s,
        reshard_s=parts.reshard_s,
        grad_sync_s=schedule.sync_s,
        exposed_grad_sync_s=schedule.exposed_s,
        # What the scheduled runtime changes against the per-use prices (``solver.pricing.comm_schedule``),
        # for ``Plan.predict`` at another batch (``solver.pricing.symbolic``).
        grad_schedule={
            "delta_s": schedule.delta_s,
            "delta_bytes": schedule.delta_bytes,
            "last_bucket_s": schedule.last_bucket_s,
            "post_solve_s": schedule.post_solve_s,
            **({"overlap_s": _overlap_s(graph, choice, parts.solution.edge_specs)} if graph.overlap is not None else {}),
            **_overlap_terms(schedule),
        },
        peak_memory_bytes=int(peak_bytes),
        peak_memory_at=graph.timeline.time_name(peak_time),
        memory_at_peak_bytes={k: int(v) for k, v in graph.timeline.breakdown(peak_time, chosen).items()},
        allocator_peak_bytes=(
            allocator_peaks(timeline_spans(graph.timeline), chosen, graph.timeline.num_times, cluster) if cluster else None
        ),
        comm_bytes=int(traffic.comm_bytes),
        comm_bytes_per_axis=tuple(int(b) for b in traffic.per_axis),
        expert_parallel=expert_parallel,
        optimizer_s=parts.optimizer_s,
    )
