r"""The inter-op stage planner: how many pipeline stages, which layers each runs, on what mesh.

Alpa's formulation (OSDI'22, §5), adapted to uniform stage meshes. A pipelined plan cuts mesh axis
0 into S equal rank groups; every stage runs on ``stage_mesh = (mesh[0] // S, *mesh[1:])``, or,
when only a device count N is given, on any mesh of N / S devices of at most ``max_axes`` axes.

Sets and data
    L             layers (``stage_costs.cluster_layers``: the repeated blocks; pre joins the
                  first stage and post the last)
    M             microbatches per step; the graph is traced at one microbatch
    S             stage counts: divisors of mesh[0] (or N) up to L; ``num_stages`` fixes one
    c ∈ C(mesh)   candidate intra-stage plans on a stage mesh (``stage_costs.CandidateSolver``),
                  each used with or without recomputation (r ∈ {0, 1})
    t(a, b, c, r) seconds of forward + backward of one microbatch for layers [a, b): the units'
                  own ops and resharding, the resharding from earlier units in the stage, and,
                  when a > 0, the point-to-point send of the values entering the stage (forward
                  activations and backward gradients, α + bytes / (|stage| β) on mesh axis 0);
                  r = 1 adds the forward again
    mem(a, b, c, r, k)  peak bytes per device with k microbatches in flight:
                  static + k · saved + max transient        (r = 0)
                  static + k · stash + max (saved + transient)  (r = 1: keeps only each layer's
                  inputs per microbatch and recomputes one layer at a time)
    sync(a, b, c) the per-step gradient all-reduces of the stage's parameters
    h ∈ {0, 1}    whether every stage holds its gathered parameters through the step
                  (``StagePlan.hold_gathered``): their gathers and reduce-scatters move from t
                  (per microbatch) to sync (per step), their whole bytes and summed gradients
                  into static; the DP runs once for each h and the faster wins

Stage i of S (0-based) holds k_i = min(S − i, M) microbatches under 1F1B. For a range it takes
the fastest (c, r) with mem ≤ budget: t_i(a, b) (∞ if none fits).

Objective (the 1F1B step)
    min over S, stage mesh, 0 = a_0 < a_1 < ... < a_S = L of
        Σ_i t_i(a_i, a_{i+1}) + (M − 1) · max_i t_i(a_i, a_{i+1}) + exposed sync + max_i opt_i
    (the syncs that the drain and each stage's last backward do not hide,
    ``solver.pricing.schedules``; opt_i the optimizer step of stage i's parameters, which every
    group runs at once after the flush)

Dynamic program (per S and stage mesh). For a cap T on the slowest stage,
    F_0(b) = t_0(0, b),  F_i(b) = min_{a < b} F_{i−1}(a) + t_i(a, b)   over t ≤ T,
and Σ = F_{S−1}(L). T runs over the distinct stage times from the smallest feasible one upward,
and stops once Σ(T = ∞) + (M − 1) · T cannot beat the best step found (Alpa's enumeration of
t_max, with an exact stopping rule). The synchronisation and optimizer terms are added to each
candidate partition found, not optimised inside the DP.

Each stage mesh starts with its fastest candidate only. Its leaner candidates are solved
where the budget made the best pipeline on that mesh slower than it is without one (or
infeasible), and that unconstrained pipeline still beats the best found: a pruning heuristic,
since a leaner candidate minimises the same whole-model objective under less memory but could
still be faster for one stage.

Layer ranges with the same (starts at 0, ends at L, length) use the same candidate solutions:
the ILP is solved per stage mesh (a few times, see ``stage_costs``), never per range.
``num_layers`` larger than the traced blocks plans a deeper model of identical blocks from a
shallow trace: interior blocks are priced as the traced block 1, which is exact for identical
layers, since every op and edge belongs to one unit.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from autopar.cost import comm
from autopar.cost import optimizer as step_cost
from autopar.cost.cluster import ClusterSpec
from autopar.errors import ConfigError, InfeasibleError, MeshError, ModelError
from autopar.ir.memory import CheckpointSegment, MemoryPlan
from autopar.ir.options import DEFAULT_OPTIMIZER, MixedPrecision, PlanOptions, to_dtype
from autopar.ir.pipeline import (
    MULTI_STAGE_SCHEDULES,
    Stage,
    StagePlan,
    check_num_stages,
    schedule_for,
    stage_mesh_of,
    stage_ranks,
)
from autopar.ir.plan import Plan
from autopar.ir.prediction import Prediction
from autopar.solver.planners.mesh_search import mesh_candidates
from autopar.solver.planners.settings import memory_budget
from autopar.solver.planners.sharding import plan_from_solution
from autopar.solver.planners.stage_costs import (
    Candidate,
    CandidateSolver,
    Layers,
    OpSplit,
    UnitCosts,
    build_stage_graph,
    cluster_layers,
    fsdp_overlay,
    split_op_costs,
    unit_costs,
)
from autopar.solver.pricing import schedules
from autopar.solver.problem.choices import ChoiceGraph
from autopar.solver.problem.fits import fits
from autopar.solver.problem.ilp import Solution
from autopar.solver.problem.op_prices import pricing_without_rides
from autopar.trace import TracedModel

log = logging.getLogger("autopar")


__all__ = ["plan_stages", "search_stages", "StageSettings", "price_chunks", "StageSearch", "StageChoice", "check_pipeline_args"]


@dataclass(frozen=True, slots=True)
class StageChoice:
    """One stage of a searched pipeline."""

    layers: tuple[int, int]
    candidate: int
    remat: bool
    time_s: float
    sync_s: float
    memory_bytes: float
    in_flight: int
    hold: bool = False  # gathers its parameters once a step and holds them (``StagePlan.hold_gathered``)
    forward_s: float = 0.0  # of ``time_s``, the forward's (where the schedule's sync overlap reads it)
    early_s: float = 0.0  # of ``sync_s``, what may run during its last backward (all but the last bucket)
    optimizer_s: float = 0.0  # its parameters' optimizer step


@dataclass(frozen=True, slots=True)
class StageSettings:
    """What the stage planner searches, and under what limits: one value for ``plan_stages`` and
    ``search_stages``, made from ``PlanOptions`` by ``of``."""

    num_microbatches: int  # M; the model is traced at one microbatch (global batch / M)
    num_stages: int | str = "auto"  # S, or "auto": the DP picks S (one stage: no split)
    memory_budget: float | None = None  # bytes per device; None: none
    time_limit_s: float = 60.0  # per ILP solve
    devices: int | None = None  # without a mesh: any stage mesh of devices / S devices ...
    max_axes: int = 2  # ... of up to this many axes
    remat: bool = False  # a stage may recompute its activations in backward to fit
    solver: str = "auto"  # "auto", "highs" or "cbc" (``solver.search.backends``)
    # How the leaner intra-stage plans are found (``stage_costs.CandidateSolver``): "lagrangian" (an
    # LP each), "budget" (a MILP each, slower, sometimes better) or "both".
    candidates: str = "lagrangian"
    # The schedules priced: "1F1B" (GPipe where M < S; one stage is always priced) and the
    # multi-stage "Interleaved1F1B" and "ZBV" (``solver.pricing.schedules``), priced on equal layers
    # per chunk with the candidates solved for 1F1B.
    schedules_allowed: tuple[str, ...] = ("1F1B",)
    forced: dict | None = None  # node name → spec on the stage mesh: what a hand plan fixes (colossal)
    optimizer_dtype: Any = None  # the optimizer state's torch dtype (a precision policy's); the params' own when None
    optimizer: str = DEFAULT_OPTIMIZER  # the optimizer the step is priced for (``PlanOptions.optimizer``)
    # For benchmarks and tests: plan ``num_layers`` identical blocks from a shallower trace; only
    # these ``stage_meshes``; price the partition ``forced_layers`` (boundaries a_0 = 0 < ... <
    # a_S = L, a published plan) instead of searching; the candidate solver's budget ``ladder``.
    num_layers: int | None = None
    stage_meshes: tuple[tuple[int, ...], ...] | None = None
    forced_layers: tuple[int, ...] | None = None
    ladder: tuple[float, ...] | None = None

    @classmethod
    def of(
        cls,
        options: PlanOptions,
        cluster: ClusterSpec,
        *,
        num_stages: int | str | None = None,
        devices: int | None = None,
        forced: dict | None = None,
    ) -> StageSettings:
        """``options`` as the stage planner reads them, for ``autopar.plan``'s pipelines and
        Colossal-AI's alike: ``num_stages`` (None: ``options.pipeline.stages``), ``devices`` where
        no mesh is given, ``forced`` a hand plan's specs. A stage may recompute its layers unless
        ``checkpointing=False``."""
        return cls(
            num_microbatches=options.pipeline.microbatches,
            num_stages=options.pipeline.stages if num_stages is None else num_stages,
            memory_budget=memory_budget(options, cluster),
            time_limit_s=options.solve.time_limit_s,
            devices=devices,
            max_axes=min(options.max_axes, 2),
            remat=options.memory.checkpointing is not False,
            solver=options.solve.solver,
            schedules_allowed=options.pipeline.schedules,
            forced=forced,
            optimizer=options.optimizer,
        )

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedules_allowed", tuple(self.schedules_allowed))
        if self.stage_meshes is not None:
            object.__setattr__(self, "stage_meshes", tuple(tuple(mesh) for mesh in self.stage_meshes))
        if self.forced_layers is not None:
            object.__setattr__(self, "forced_layers", tuple(self.forced_layers))
        unknown = set(self.schedules_allowed) - set(schedules.ALL_SCHEDULES)
        if unknown:
            raise ConfigError(f"schedules must be among {schedules.ALL_SCHEDULES}, got {sorted(unknown)}")


@dataclass
class StageSearch:
    """The best pipeline found, and every (stages, stage mesh) tried."""

    num_stages: int
    stage_mesh: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    stages: list[StageChoice]
    step_time_s: float
    num_microbatches: int = 1
    rows: list[dict[str, Any]] = field(default_factory=list)
    ilp_solves: int = 0
    search_time_s: float = 0.0
    schedule: str = "1F1B"
    virtual_stages: int = 1
    reason: str = ""

    @property
    def hold_gathered(self) -> bool:
        return any(stage.hold for stage in self.stages)

    @property
    def optimizer_s(self) -> float:
        """The optimizer step after the flush: every rank group steps its chunks' parameters at
        once, so the step waits for the slowest group's."""
        return _groups_optimizer_s(self.schedule, self.num_stages, self.stages)

    @property
    def bubble_fraction(self) -> float:
        times = [s.time_s for s in self.stages]
        pipeline_s = self.step_time_s - max(self.exposed_syncs()) - self.optimizer_s
        return schedules.bubble(self.num_stages, self.num_microbatches, times, pipeline_s)

    def exposed_syncs(self) -> list[float]:
        """Per rank group, what of its gradient syncs its backward does not hide (``schedules.exposed_syncs``)."""
        return schedules.exposed_syncs(self.schedule, self.num_stages, *_chunk_columns(self.stages))


def _chunk_columns(chunks: Sequence[StageChoice]) -> tuple[list[float], ...]:
    """Per chunk: its time, forward, sync and early sync (``schedules.step_time``'s columns)."""
    return (
        [c.time_s for c in chunks],
        [c.forward_s for c in chunks],
        [c.sync_s for c in chunks],
        [c.early_s for c in chunks],
    )


def _groups_optimizer_s(schedule: str, num_groups: int, chunks: Sequence[StageChoice]) -> float:
    per_group = [0.0] * num_groups
    for j, chunk in enumerate(chunks):
        per_group[schedules.group_of(schedule, num_groups, j)] += chunk.optimizer_s
    return max(per_group)


def _step_s(schedule: str, num_groups: int, num_microbatches: int, chunks: Sequence[StageChoice]) -> float:
    """One step of ``chunks`` under ``schedule``: the pipeline's (``schedules.step_time``) and the
    slowest group's optimizer step after it."""
    pipeline_s = schedules.step_time(schedule, num_groups, num_microbatches, *_chunk_columns(chunks))
    return pipeline_s + _groups_optimizer_s(schedule, num_groups, chunks)


class _MeshCosts:
    """Per stage mesh: the candidates and, over the real layers, the per-option matrices."""

    def __init__(
        self,
        traced: TracedModel,
        layers: Layers,
        stage_mesh: tuple[int, ...],
        cluster: ClusterSpec,
        num_layers: int,
        settings: StageSettings,
    ):
        self.stage_mesh, self.layers, self.cluster, self.remat = stage_mesh, layers, cluster, settings.remat
        self.graph: ChoiceGraph = build_stage_graph(
            traced, stage_mesh, cluster, settings.optimizer_dtype, settings.forced, settings.optimizer
        )
        self.split: OpSplit = split_op_costs(self.graph, cluster)
        self._settings = settings
        self.implementation = step_cost.implementation(cluster, self.graph.optimizer)  # the optimizer step's
        self.solver = self._solver(settings, hold=False)
        self.solvers = [self.solver]
        self.rep = _representatives(layers.num_blocks, num_layers)
        self.num_layers = num_layers
        self.candidates: list[Candidate] = []
        self.options: list[tuple[int, bool, bool]] = []  # (candidate, recompute, hold gathered parameters)
        self.matrices: list[dict[str, np.ndarray]] = []
        self._fastest = self.solver.fastest()
        self._add(self._fastest)

    def _solver(self, settings: StageSettings, hold: bool) -> CandidateSolver:
        kwargs = {} if settings.ladder is None else {"ladder": settings.ladder}
        return CandidateSolver(
            self.graph,
            self.split,
            settings.num_microbatches,
            settings.time_limit_s,
            settings.solver,
            mode=settings.candidates,
            hold=hold,
            **kwargs,
        )

    @property
    def ilp_solves(self) -> int:
        return sum(solver.solves for solver in self.solvers)

    def add_leaner(self) -> bool:
        """Solve the leaner candidates (once); whether any was found. Beside the Lagrangian
        rungs: on a stage mesh of several devices, the fastest plan of a second ILP that prices
        a parameter's resharding once a step, as a stage that holds its gathered parameters runs
        it (``StagePlan.hold_gathered``), and each fastest plan with FSDP laid over it
        (``_overlays``). (The second ILP's own rungs changed none of the plans autopar chose for
        bench_alpa's jobs and the 405B job, at 1.5 to 2.5 times their planning time.)"""
        if self.solver.laddered or not self.candidates:
            return False
        added = len(self.candidates)
        fastest = list(self._fastest)
        if fastest:
            self._add(self.solver.leaner(fastest[0]))
        if math.prod(self.stage_mesh) > 1:
            self.solvers.append(self._solver(self._settings, hold=True))
            held = self.solvers[-1].fastest()
            self._add(held)
            fastest += held
        for plan in fastest:
            self._add(self._overlays(plan))
        return len(self.candidates) > added

    def _overlays(self, fastest: Candidate) -> list[Candidate]:
        """``fastest`` with FSDP laid over it on each stage-mesh axis (``stage_costs.fsdp_overlay``):
        the layout teams run (tensor parallel in a node, FSDP across), which no rung of the
        Lagrangian need reach."""
        found = []
        for axis, size in enumerate(self.stage_mesh):
            choice = fsdp_overlay(self.graph, fastest.solution.choice, axis) if size > 1 else None
            if choice is not None:
                found.append(Candidate(dataclasses.replace(fastest.solution, choice=choice), None))
        return found

    def _add(self, candidates: list[Candidate]) -> None:
        known = {tuple(sorted(c.solution.choice.items())) for c in self.candidates}
        for candidate in candidates:
            key = tuple(sorted(candidate.solution.choice.items()))
            if key in known:
                continue
            known.add(key)
            index = len(self.candidates)
            self.candidates.append(candidate)
            choice = candidate.solution.choice
            candidate.units = unit_costs(self.graph, self.layers, self.split, choice, self.cluster)
            held = unit_costs(self.graph, self.layers, self.split, choice, self.cluster, hold=True)
            candidate.held_units = held if not np.array_equal(held.sync, candidate.units.sync) else None
            for hold, units in ((False, candidate.units), (True, candidate.held_units)):
                if units is None:
                    continue
                for remat in (False, True) if self.remat else (False,):
                    self.options.append((index, remat, hold))
                    self.matrices.append(
                        _option_matrices(units, self.rep, self.num_layers, remat, self._settings.num_microbatches)
                    )

    def chunk(self, option: int, bounds: tuple[int, int], time_s: float, memory_bytes: float, in_flight: int) -> StageChoice:
        """Layers ``bounds`` under ``option`` as one chunk of a pipeline, taking ``time_s`` a
        microbatch (sends included) and ``memory_bytes`` with ``in_flight`` microbatches held."""
        c, remat, hold = self.options[option]
        mat, (a, b) = self.matrices[option], bounds
        tensors = int(mat["optimizer_tensors"][a, b])
        floor = step_cost.list_kernels_floor_s(tensors, self.cluster, self.implementation, self.stage_mesh)
        return StageChoice(
            (a, b),
            c,
            remat,
            time_s,
            float(mat["sync"][a, b]),
            memory_bytes,
            in_flight,
            hold,
            forward_s=float(mat["fwd"][a, b]),
            early_s=float(mat["early"][a, b]),
            optimizer_s=max(float(mat["optimizer"][a, b]), floor),
        )

    def holds(self) -> bool:
        """Whether some candidate gathers parameters, which a stage may hold through the step."""
        return any(hold for _, _, hold in self.options)

    def best(self, in_flight: int, budget: float | None, send, hold: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(t, option) matrices over [a, b): the fastest option that fits with k in flight
        (among the options that hold gathered parameters, or among those that do not)."""
        best_t = None
        best_o = None
        for o, mat in enumerate(self.matrices):
            if self.options[o][2] != hold:
                continue
            t = mat["time"] + send(mat)
            if budget is not None:
                need = mat["static"] + in_flight * mat["per_microbatch"] + mat["peak"]
                t = np.where(fits(need, budget), t, np.inf)
            if best_t is None:
                best_t, best_o = t, np.full(t.shape, o, dtype=int)
            else:
                better = t < best_t
                best_t = np.where(better, t, best_t)
                best_o = np.where(better, o, best_o)
        return best_t, best_o


def _representatives(traced_blocks: int, num_layers: int) -> np.ndarray:
    """Position in the traced units (0 pre, 1..L_t blocks, L_t + 1 post) of each real position
    (0 pre, 1..L blocks, L + 1 post). A deeper model than traced prices its first and last
    blocks as the traced first and last, and every other block as traced block 1, which (like
    them) reads a block's output and feeds a block. The last block is not a stand-in for the
    others: ops that follow its module call (an activation applied in the parent's loop) fall
    into post."""
    if num_layers == traced_blocks:
        return np.arange(num_layers + 2)
    if traced_blocks < 3:
        raise ModelError(
            f"planning {num_layers} layers from a trace of {traced_blocks} blocks needs at least 3 "
            "traced blocks (the first, an interior one and the last): trace a deeper model"
        )
    rep = np.full(num_layers + 2, 2)
    rep[0], rep[1] = 0, 1
    rep[num_layers], rep[num_layers + 1] = traced_blocks, traced_blocks + 1
    return rep


def _bounds(num_layers: int):
    """lo[a], hi[b]: unit positions of a stage [a, b) (pre with a = 0, post with b = L)."""
    lo = np.arange(num_layers) + 1
    lo[0] = 0
    hi = np.arange(num_layers + 1) + 1
    hi[num_layers] = num_layers + 2
    return lo, hi


def _holds_any(positions: frozenset[int], rep: np.ndarray, num_layers: int) -> np.ndarray:
    """Over (a, b): 1 where the range holds one of the traced units ``positions`` (unit - 1), else 0."""
    lo, hi = _bounds(num_layers)
    p = np.zeros(num_layers + 2)
    p[np.nonzero(np.isin(rep - 1, list(positions)))[0]] = 1.0
    count = np.concatenate([[0.0], np.cumsum(p)])
    return ((count[hi][None, :] - count[lo][:, None]) > 0).astype(float)


def _option_matrices(
    units: UnitCosts, rep: np.ndarray, num_layers: int, remat: bool, num_microbatches: int
) -> dict[str, np.ndarray]:
    """Matrices over (a, b) of one option's stage time (a microbatch's, with its share of the
    gradient sums of ``num_microbatches``), sync, optimizer, memory terms and crossing bytes."""
    L = num_layers
    lo, hi = _bounds(L)
    valid = lo[:, None] < hi[None, :]
    valid &= np.arange(L)[:, None] < np.arange(L + 1)[None, :]

    def prefix(values: np.ndarray) -> np.ndarray:
        return np.concatenate([[0.0], np.cumsum(values[rep])])

    def ranged(values: np.ndarray) -> np.ndarray:
        p = prefix(values)
        return p[hi][None, :] - p[lo][:, None]

    def range_max(values: np.ndarray) -> np.ndarray:
        real = values[rep]
        out = np.zeros((L, L + 1))
        for a in range(L):
            running = np.maximum.accumulate(real[lo[a] :])  # running[j]: max over lo..lo+j
            for b in range(a + 1, L + 1):
                out[a, b] = running[hi[b] - 1 - lo[a]]
        return out

    starts_late = (lo > 0)[:, None]
    total = units.own + units.prev + units.pre
    time_s = ranged(total) - starts_late * (units.prev[rep][lo][:, None] + ranged(units.pre))
    if remat:
        time_s = time_s + ranged(units.fwd)
    static = ranged(units.static) + sum((size * _holds_any(us, rep, L) for size, us in units.shared), np.zeros((L, L + 1)))
    optimizer, tensors, adding = ranged(units.optimizer), ranged(units.optimizer_tensors), ranged(units.accumulate)
    for seconds, added, us in units.shared_steps:
        held = _holds_any(us, rep, L)
        optimizer, tensors, adding = optimizer + seconds * held, tensors + held, adding + added * held
    # every microbatch but the first adds its gradients into the step's sums
    time_s = time_s + adding * (num_microbatches - 1) / num_microbatches
    # All but the last bucket of a stage's synced gradients may sync during its backward.
    sync, synced = ranged(units.sync), ranged(units.synced_bytes)
    last_bucket = sync * np.minimum(1.0, comm.HELD_BUCKET_BYTES / np.maximum(synced, 1.0))
    if remat:
        per_microbatch = ranged(units.stash)
        peak = range_max(units.saved + units.transient)
    else:
        per_microbatch = ranged(units.saved)
        peak = range_max(units.transient)
    # A stage that starts late receives from pre what its blocks read from there (rotary
    # tables, say); never the input of block 0 (the embedding), which only the first stage runs.
    pre_max = units.pre_bytes[rep][2:].max(axis=0)
    crossing = np.where(starts_late[..., None], units.prev_bytes[rep][lo][:, None, :] + pre_max, 0.0)
    crossing = np.broadcast_to(crossing, (L, L + 1, 2))
    inf = np.where(valid, 0.0, np.inf)
    return {
        "time": time_s + inf,
        "sync": sync,
        "early": sync - last_bucket,
        "optimizer": optimizer,
        "optimizer_tensors": tensors,
        "static": static,
        "fwd": ranged(units.fwd),
        "per_microbatch": per_microbatch,
        "peak": peak,
        "crossing": crossing,
    }


def _sender(stage_mesh, full_mesh, cluster):
    """Seconds to send the crossing bytes (forward, backward) into each stage: every device of
    the stage receives its share over mesh axis 0's link, α + bytes / (|stage| β) each way."""
    devices = math.prod(stage_mesh)
    link = cluster.axis_link(full_mesh, 0)

    def send(mat):
        if full_mesh[0] == stage_mesh[0]:
            return np.zeros(mat["time"].shape)  # one stage: nothing crosses
        crossing = mat["crossing"]
        seconds = np.where(crossing > 0, link.latency_s + crossing / devices / link.bandwidth_bytes_per_s, 0.0)
        return seconds.sum(axis=-1)

    return send


def _dp(tables: list[np.ndarray], cap: float) -> tuple[float, list[int]] | None:
    """min Σ t_i over partitions with every t_i ≤ cap: (Σ, boundaries a_0..a_S) or None."""
    L = tables[0].shape[0]
    masked = [np.where(t <= cap, t, np.inf) for t in tables]
    f = masked[0][0].copy()
    back = []
    for t in masked[1:]:
        total = f[:L, None] + t
        arg = np.argmin(total, axis=0)
        f = total[arg, np.arange(L + 1)]
        back.append(arg)
    if not np.isfinite(f[L]):
        return None
    bounds = [L]
    for arg in reversed(back):
        bounds.append(int(arg[bounds[-1]]))
    bounds.append(0)
    return float(f[L]), bounds[::-1]


def _search_partition(tables: list[np.ndarray], num_microbatches: int, score) -> tuple[float, list[int]] | None:
    """The partition of least ``score`` among the DP's optima over caps on the slowest stage."""
    values = np.unique(np.concatenate([t[np.isfinite(t)] for t in tables]))
    if values.size == 0 or _dp(tables, math.inf) is None:
        return None
    lower = _dp(tables, math.inf)[0]
    low, high = 0, len(values) - 1
    while low < high:  # the smallest cap with a feasible partition
        mid = (low + high) // 2
        if _dp(tables, values[mid]) is None:
            low = mid + 1
        else:
            high = mid
    best: tuple[float, list[int]] | None = None
    index = low
    while index < len(values):
        cap = values[index]
        if best is not None and lower + (num_microbatches - 1) * cap >= best[0]:
            break
        found = _dp(tables, cap)
        if found is not None:
            value = score(found[1])
            if best is None or value < best[0]:
                best = (value, found[1])
            slowest = max(tables[i][found[1][i], found[1][i + 1]] for i in range(len(tables)))
            index = max(index + 1, int(np.searchsorted(values, slowest, side="right")))
        else:
            index += 1
    return best


def _price(
    mesh_costs: _MeshCosts, S: int, M: int, budget: float | None, cluster: ClusterSpec, forced_layers: Sequence[int] | None
) -> tuple:
    """(step seconds or None, the step without a memory budget, the stages) of the best
    partition into S stages on this stage mesh (or of ``forced_layers``)."""
    stage_mesh = mesh_costs.stage_mesh
    full = (S * stage_mesh[0], *stage_mesh[1:])
    if not mesh_costs.candidates:
        return None, math.inf, []
    send = _sender(stage_mesh, full, cluster)

    def solve(limit, hold):
        per_k = {}
        for i in range(S):
            k = min(S - i, M)
            if k not in per_k:
                per_k[k] = mesh_costs.best(k, limit, send, hold)
        tables = [per_k[min(S - i, M)][0] for i in range(S)]
        options = [per_k[min(S - i, M)][1] for i in range(S)]

        def stages_of(bounds: list[int]) -> list[StageChoice]:
            out = []
            for i in range(S):
                a, b = bounds[i], bounds[i + 1]
                o = int(options[i][a, b])
                mat = mesh_costs.matrices[o]
                k = min(S - i, M)
                memory_bytes = float(mat["static"][a, b] + k * mat["per_microbatch"][a, b] + mat["peak"][a, b])
                out.append(mesh_costs.chunk(o, (a, b), float(tables[i][a, b]), memory_bytes, k))
            return out

        def score(bounds: list[int]) -> float:
            return _step_s(schedule_for(S, M), S, M, stages_of(bounds))

        if forced_layers is not None:
            bounds = list(forced_layers)
            valid = all(np.isfinite(tables[i][bounds[i], bounds[i + 1]]) for i in range(S))
            found = (score(bounds), bounds) if valid else None
        else:
            found = _search_partition(tables, M, score)
        return (None, []) if found is None else (found[0], stages_of(found[1]))

    # Every stage holds its gathered parameters, or none does (``StagePlan.hold_gathered``).
    holds = (False, True) if mesh_costs.holds() else (False,)
    value, stages, bound = None, [], math.inf
    for hold in holds:
        found, chosen = solve(budget, hold)
        if found is not None and (value is None or found < value):
            value, stages = found, chosen
        unbounded = found if budget is None else solve(None, hold)[0]
        bound = min(bound, math.inf if unbounded is None else unbounded)
    return value, bound, stages


def _balanced_bounds(num_layers: int, num_chunks: int) -> list[int]:
    """Boundaries of ``num_chunks`` contiguous ranges of as equal layer counts as can be."""
    return [round(i * num_layers / num_chunks) for i in range(num_chunks + 1)]


def price_chunks(
    mesh_costs: _MeshCosts,
    S: int,
    v: int,
    M: int,
    schedule: str,
    budget: float | None,
    cluster: ClusterSpec,
    recompute: bool | None = None,
) -> tuple[float | None, list[StageChoice]]:
    """A multi-stage schedule (``solver.pricing.schedules``) on S groups of v chunks each: equal layer
    counts per chunk, and one intra-stage option (candidate, recomputation) for every chunk, the
    fastest whose every group fits ``budget`` (``recompute`` True or False: only options that do,
    or do not, recompute; benchmarks price a published layout with it). (step seconds or None,
    the chunks)."""
    stage_mesh = mesh_costs.stage_mesh
    send = _sender(stage_mesh, (S * stage_mesh[0], *stage_mesh[1:]), cluster)
    bounds = _balanced_bounds(mesh_costs.num_layers, S * v)
    ranges = [(bounds[j], bounds[j + 1]) for j in range(S * v)]
    groups = [schedules.group_of(schedule, S, j) for j in range(S * v)]
    best: tuple[float, list[StageChoice]] | None = None
    for o, mat in enumerate(mesh_costs.matrices):
        c, remat, hold = mesh_costs.options[o]
        # ZBV's weight passes need the gathers in the microbatches' graphs (``passes.held``)
        if ((remat or hold) and schedule == "ZBV") or recompute not in (None, remat):
            continue
        seconds = mat["time"] + send(mat)
        times = [float(seconds[a, b]) for a, b in ranges]
        memory = []
        for r in range(S):
            mine = [(a, b) for (a, b), g in zip(ranges, groups) if g == r]
            k = schedules.in_flight(schedule, S, v, M, r)
            memory.append(
                sum(float(mat["static"][a, b]) for a, b in mine)
                + k * sum(float(mat["per_microbatch"][a, b]) for a, b in mine) / len(mine)
                + max(float(mat["peak"][a, b]) for a, b in mine)
            )
        if not all(math.isfinite(t) for t in times) or (budget is not None and max(memory) > budget * (1 + 1e-9)):
            continue
        chunks = [
            mesh_costs.chunk(o, (a, b), t, memory[g], schedules.in_flight(schedule, S, v, M, g))
            for (a, b), t, g in zip(ranges, times, groups)
        ]
        value = _step_s(schedule, S, M, chunks)
        if best is None or value < best[0]:
            best = (value, chunks)
    return (None, []) if best is None else best


def check_pipeline_args(
    num_stages, num_microbatches, mesh_shape: Sequence[int] | None, devices: int | None, num_layers: int
) -> list[int]:
    """The stage counts to try; a ValueError naming the cause and the fix otherwise."""
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ConfigError(f"num_microbatches must be a positive int, got {num_microbatches!r}")
    axis0 = mesh_shape[0] if mesh_shape is not None else devices
    where = f"mesh axis 0 ({axis0})" if mesh_shape is not None else f"the {devices} devices"
    if num_stages == "auto":
        counts = [s for s in range(1, axis0 + 1) if axis0 % s == 0 and s <= num_layers]
        return counts
    check_num_stages(axis0, num_stages, where)
    if num_stages > num_layers:
        raise ConfigError(
            f"pipeline={num_stages} stages, but the model has only {num_layers} layers to split "
            f"(its repeated blocks): use at most {num_layers} stages"
        )
    return [num_stages]


def search_stages(
    traced: TracedModel,
    mesh_shape: Sequence[int] | None,
    cluster: ClusterSpec,
    settings: StageSettings,
    layers: Layers | None = None,
) -> tuple[StageSearch, dict]:
    """Run the DP of the module docstring; returns the best pipeline and the per-mesh costs.

    ``traced`` is the model traced at one microbatch. Give ``mesh_shape`` (stages cut its axis 0)
    or ``settings.devices`` (the stage mesh is any mesh of devices / S devices of up to
    ``settings.max_axes`` axes, and the full mesh is (S · a, b, ...)). ``layers``: the model's
    layer clustering, where the caller has it (``stage_costs.cluster_layers``).
    """
    start = time.perf_counter()
    layers = layers or cluster_layers(traced)
    num_layers = settings.num_layers or layers.num_blocks
    if mesh_shape is None and settings.devices is None:
        raise MeshError("plan_stages needs mesh_shape, or devices=N to choose the stage mesh")
    combos = _combos(mesh_shape, settings, num_layers)
    costs: dict[tuple[int, ...], _MeshCosts] = {}
    for _, stage_mesh in combos:
        if stage_mesh not in costs:
            # the other stages' ranks share the nodes (on a CPU host, its cores: ``compute_share``)
            copies = (math.prod(mesh_shape) if mesh_shape is not None else settings.devices) // math.prod(stage_mesh)
            stage_cluster = dataclasses.replace(cluster, concurrent_meshes=copies)
            costs[stage_mesh] = _MeshCosts(traced, layers, stage_mesh, stage_cluster, num_layers, settings)
    results = _price_combos(combos, costs, settings, cluster)
    priced = {
        (S, mesh, schedule_for(S, settings.num_microbatches), 1): (value, found)
        for (S, mesh), (value, _, found) in results.items()
        if "1F1B" in settings.schedules_allowed or S == 1
    }
    priced.update(_price_multi_stage(combos, costs, settings, cluster, num_layers))
    best, rows = _best_of(priced, costs, settings.num_microbatches)
    if best is None:
        detail = "; ".join(f"{r['stages']} stages on {tuple(r['stage_mesh'])}: {r['status']}" for r in rows[:6])
        raise InfeasibleError(
            f"no pipeline of {num_layers} layers fits memory_budget={settings.memory_budget} with "
            f"{settings.num_microbatches} microbatches ({detail}): raise the budget, use more devices or "
            "microbatches, or more stages"
        )
    best.rows = rows
    best.reason = _reason(best, rows, settings.memory_budget)
    best.ilp_solves = sum(c.ilp_solves for c in costs.values())
    best.search_time_s = time.perf_counter() - start
    return best, costs


def _combos(mesh_shape: Sequence[int] | None, settings: StageSettings, num_layers: int) -> list[tuple]:
    """The (stage count S, stage mesh) pairs to price."""
    counts = check_pipeline_args(
        settings.num_stages, settings.num_microbatches, tuple(mesh_shape) if mesh_shape else None, settings.devices, num_layers
    )
    if settings.forced_layers is not None:
        counts = [len(settings.forced_layers) - 1]
    combos = []
    for S in counts:
        if mesh_shape is not None:
            meshes = [stage_mesh_of(mesh_shape, S)]
        else:
            meshes = mesh_candidates(settings.devices // S, settings.max_axes)
        if settings.stage_meshes is not None:
            meshes = [m for m in meshes if tuple(m) in {tuple(x) for x in settings.stage_meshes}]
        combos += [(S, tuple(m)) for m in meshes]
    return combos


def _price_combos(combos: list[tuple], costs: dict, settings: StageSettings, cluster: ClusterSpec) -> dict:
    """(S, stage mesh) → ``_price``'s (step or None, step without a budget, stages) under 1F1B.

    Pass 1: every (S, stage mesh) with the fastest candidate of its mesh. Pass 2: where memory
    made the pipeline slower than it would be without a budget (or infeasible), and that
    unconstrained bound could beat the best found, add the mesh's leaner candidates."""
    M, budget, forced_layers = settings.num_microbatches, settings.memory_budget, settings.forced_layers
    results = {(S, mesh): _price(costs[mesh], S, M, budget, cluster, forced_layers) for S, mesh in combos}
    best_value = min((r[0] for r in results.values() if r[0] is not None), default=math.inf)
    for combo in sorted(combos, key=lambda c: results[c][1]):
        value, bound = results[combo][:2]
        if bound >= best_value or (value is not None and value <= bound * (1 + 1e-9)):
            continue
        if costs[combo[1]].add_leaner():
            for other in combos:
                if other[1] == combo[1]:
                    results[other] = _price(costs[other[1]], other[0], M, budget, cluster, forced_layers)
            best_value = min((r[0] for r in results.values() if r[0] is not None), default=math.inf)
    return results


def _price_multi_stage(combos: list[tuple], costs: dict, settings: StageSettings, cluster: ClusterSpec, num_layers: int) -> dict:
    """The multi-stage schedules, on the candidates the 1F1B search solved."""
    priced = {}
    M = settings.num_microbatches
    for S, stage_mesh in combos:
        for schedule in (s for s in settings.schedules_allowed if s in MULTI_STAGE_SCHEDULES):
            for v in schedules.virtual_counts(schedule, S, M, num_layers) if settings.forced_layers is None else ():
                priced[(S, stage_mesh, schedule, v)] = price_chunks(
                    costs[stage_mesh], S, v, M, schedule, settings.memory_budget, cluster
                )
    return priced


def _best_of(priced: dict, costs: dict, M: int) -> tuple[StageSearch | None, list[dict[str, Any]]]:
    """The fastest priced pipeline, and a row per one priced (feasible first, fastest first)."""
    rows: list[dict[str, Any]] = []
    best: StageSearch | None = None
    for (S, stage_mesh, schedule, v), (value, found) in priced.items():
        full = (S * stage_mesh[0], *stage_mesh[1:])
        row = {
            "stages": S,
            "stage_mesh": list(stage_mesh),
            "mesh": list(full),
            "status": "ok",
            "schedule": schedule,
            "virtual_stages": v,
            "step_time_s": value,
            "layers": None,
            "peak_bytes": None,
        }
        if value is None:
            row["status"] = "infeasible" if costs[stage_mesh].candidates else "no intra-stage plan"
        else:
            row["layers"] = [s.layers[1] - s.layers[0] for s in found]
            row["peak_bytes"] = max(s.memory_bytes for s in found)
            if best is None or value < best.step_time_s:
                best = StageSearch(S, stage_mesh, full, found, value, num_microbatches=M, schedule=schedule, virtual_stages=v)
        rows.append(row)
    rows.sort(key=lambda r: (r["status"] != "ok", r["step_time_s"] or 0.0, r["stages"]))
    return best, rows


def _reason(best: StageSearch, rows: list[dict[str, Any]], memory_budget: float | None) -> str:
    """Why this pipeline: its step against the best of every other schedule and stage count."""
    gib = 2**30
    peak = max(s.memory_bytes for s in best.stages)
    budget = "no budget" if memory_budget is None else f"budget {memory_budget / gib:.1f} GiB"
    text = (
        f"{best.schedule} on {best.num_stages} stages of {'x'.join(map(str, best.stage_mesh))}"
        f"{f', {best.virtual_stages} virtual stages each' if best.virtual_stages > 1 else ''}, "
        f"{best.num_microbatches} microbatches: {best.step_time_s:.4g} s per step, bubble "
        f"{best.bubble_fraction:.1%}, peak {peak / gib:.1f} GiB ({budget})"
    )
    others = {}
    for row in rows:
        if row["status"] != "ok" or (row["stages"], row["schedule"], row["virtual_stages"]) == (
            best.num_stages,
            best.schedule,
            best.virtual_stages,
        ):
            continue
        key = (row["schedule"], row["stages"] == best.num_stages)
        if key not in others:
            others[key] = row
    beaten = []
    for r in others.values():
        virtual = f" x{r['virtual_stages']}" if r["virtual_stages"] > 1 else ""
        beaten.append(f"{r['schedule']}{virtual} on {r['stages']} stages {r['step_time_s']:.4g} s")
    infeasible = sorted(
        {r["schedule"] for r in rows if r["status"] != "ok"} - {r["schedule"] for r in others.values()} - {best.schedule}
    )
    if beaten:
        text += "; beats " + ", ".join(beaten)
    if infeasible:
        text += "; " + ", ".join(infeasible) + " did not fit"
    return text


def plan_stages(
    traced: TracedModel,
    mesh_shape: Sequence[int] | None,
    cluster: ClusterSpec,
    settings: StageSettings,
    precision: MixedPrecision | None = None,
) -> Plan:
    """A pipelined Plan for ``traced`` (traced at one microbatch: global batch / M).

    ``settings.num_stages`` is a number S (mesh axis 0 is cut into S groups) or "auto" (the DP of the
    module docstring picks S, one stage meaning no split). The plan's ``pipeline`` is a
    ``StagePlan`` over the forward op nodes; ``nodes`` and ``params`` hold the intra-stage
    decisions for ``pipeline.stage_mesh``; ``mesh_shape`` is the whole mesh.

    ``settings.remat`` lets a stage recompute its activations in backward when that is what fits
    (``predicted.recompute`` says which stages do, and ``plan.memory.checkpoint`` holds their
    segments, one per layer, which the runtime checkpoints). A plan of one stage runs its M microbatches
    one after another (gradient accumulation).

    ``precision`` is the policy ``traced`` was traced under: the optimizer state is priced in the
    dtype the optimizer steps, the policy's stored one (None: the model's own; in place of
    ``settings.optimizer_dtype``), and the plan records the policy (as ``solver.solve`` does).
    """
    if precision is not None:
        settings = dataclasses.replace(settings, optimizer_dtype=to_dtype(precision.stored_dtype))
    layers = cluster_layers(traced)
    with pricing_without_rides():  # a stage's loss never rides its data check (runtime.pipeline)
        search, costs = search_stages(traced, mesh_shape, cluster, settings, layers)
        mesh_costs = costs[search.stage_mesh]
        return dataclasses.replace(
            _assemble(traced, layers, search, mesh_costs, cluster, settings.memory_budget),
            precision=precision,
            optimizer=settings.optimizer,
            memory=_checkpointing(layers, search, mesh_costs),
        )


def _checkpointing(layers: Layers, search: StageSearch, mesh_costs: _MeshCosts) -> MemoryPlan | None:
    """The checkpoint segments of the stages that recompute: one per unit (pre, each block,
    post), as the ``remat`` memory model prices them (each unit's input kept per microbatch in
    flight, one unit's activations rebuilt at a time). None when no stage recomputes."""
    L = layers.num_blocks
    segments, peaks, before, added = [], [], [], 0.0
    for chosen in search.stages:
        peaks.append(chosen.memory_bytes)
        if not chosen.remat:
            before.append(chosen.memory_bytes)
            continue
        a, b = chosen.layers
        plain = mesh_costs.matrices[mesh_costs.options.index((chosen.candidate, False, chosen.hold))]
        before.append(float(plain["static"][a, b] + chosen.in_flight * plain["per_microbatch"][a, b] + plain["peak"][a, b]))
        candidate = mesh_costs.candidates[chosen.candidate]
        units = candidate.held_units if chosen.hold else candidate.units
        recompute = 0.0
        for u in range(-1 if a == 0 else a, L + 1 if b == L else b):
            at = int(mesh_costs.rep[u + 1])  # the traced unit that prices it (itself, unless planned deeper)
            names = layers.names[at]
            if not names:
                continue
            name = "pre" if u < 0 else "post" if u == L else f"{layers.list_path or 'layer'}.{u}"
            segments.append(
                CheckpointSegment(
                    name, names[0], names[-1], float(max(units.saved[at] - units.stash[at], 0.0)), float(units.fwd[at])
                )
            )
            recompute += float(units.fwd[at])
        added = max(added, search.num_microbatches * recompute)
    if not segments:
        return None
    return MemoryPlan(
        target="cpu",
        prefetch=False,
        checkpoint=tuple(segments),
        peak_before_bytes=max(before),
        peak_bytes=max(peaks),
        added_s=added,
    )


def _stage_choices(
    graph: ChoiceGraph, layers: Layers, search: StageSearch, mesh_costs: _MeshCosts, stage_of_unit: dict[int, int]
) -> tuple[dict[str, int], dict[int, tuple]]:
    """The whole graph's (node → strategy, edge → (src, dst) spec) under each stage's candidate."""
    L = layers.num_blocks
    consumer_unit: dict[str, int] = {}
    for edge in graph.edges:
        if edge.producer not in layers.unit and edge.consumer in layers.unit:
            unit = layers.unit[edge.consumer]
            consumer_unit[edge.producer] = min(consumer_unit.get(edge.producer, unit), unit)
    choice: dict[str, int] = {}
    for name in graph.order:
        unit = layers.unit.get(name, consumer_unit.get(name, L))
        stage = search.stages[stage_of_unit.get(unit, len(search.stages) - 1)]
        choice[name] = mesh_costs.candidates[stage.candidate].solution.choice[name]
    # A tied parameter (an embedding and an LM head in different stages) is one tensor with one
    # placement: every placeholder of it takes the choice of the first one, and a stage that
    # wants another placement reshards it like any input.
    for names in graph.ties:
        for name in names[1:]:
            choice[name] = choice[names[0]]
    stage_index = {name: stage_of_unit[u] for name, u in layers.unit.items()}
    edge_specs = {}
    for e, edge in enumerate(graph.edges):
        src = graph.choices[edge.producer].strategies[choice[edge.producer]].outs[edge.out_index]
        dst = graph.choices[edge.consumer].strategies[choice[edge.consumer]].ins[edge.in_index]
        crosses = (
            edge.producer in stage_index
            and edge.consumer in stage_index
            and stage_index[edge.producer] != stage_index[edge.consumer]
        )
        # A value crossing stages arrives as the consumer wants it (priced as the send).
        edge_specs[e] = (src, src) if crosses or (src, dst) not in edge.price and src != dst else (src, dst)
    return choice, edge_specs


def _assemble(
    traced: TracedModel, layers: Layers, search: StageSearch, mesh_costs: _MeshCosts, cluster: ClusterSpec, memory_budget
) -> Plan:
    graph = mesh_costs.graph
    L = layers.num_blocks
    ranks = stage_ranks(search.mesh_shape, search.num_stages)
    stage_of_unit: dict[int, int] = {}
    stages: list[Stage] = []
    for index, chosen in enumerate(search.stages):
        a, b = chosen.layers
        first, last = (-1 if a == 0 else a), (L + 1 if b == L else b)
        for u in range(first, last):
            stage_of_unit[u] = index
        group = schedules.group_of(search.schedule, search.num_stages, index)
        stages.append(Stage(index, (a, b), tuple(layers.nodes_of(first, last)), ranks[group], chosen.time_s, chosen.memory_bytes))
    choice, edge_specs = _stage_choices(graph, layers, search, mesh_costs, stage_of_unit)
    first = mesh_costs.candidates[0].solution
    solution = Solution(
        choice,
        edge_specs,
        first.status,
        search.step_time_s,
        first.solve_time_s,
        first.num_variables,
        first.num_constraints,
        method=first.method,
        backend=first.backend,
    )
    base = plan_from_solution(traced, graph, solution, cluster, memory_budget, allocator=False)  # stages: not simulated
    times = [s.time_s for s in search.stages]
    pipeline = StagePlan(
        num_microbatches=search.num_microbatches,
        schedule=search.schedule,
        stage_mesh=tuple(search.stage_mesh),
        stages=tuple(stages),
        step_time_s=search.step_time_s - search.optimizer_s,
        bubble_fraction=search.bubble_fraction,
        virtual_stages=search.virtual_stages,
        reason=search.reason,
        hold_gathered=search.hold_gathered,
    )
    # The whole-graph figures of ``plan_from_solution`` describe one microbatch run as a single
    # stage on the stage mesh: kept apart, so that they are not read as the pipeline's step.
    whole = ("compute_s", "reshard_s", "comm_bytes", "comm_bytes_per_axis")
    unpipelined = base.predicted.to_json()
    syncs = [s.sync_s for s in search.stages]
    groups = [schedules.group_of(search.schedule, search.num_stages, j) for j in range(len(syncs))]
    predicted = Prediction(
        step_time_s=search.step_time_s,
        peak_memory_bytes=int(max(s.memory_bytes for s in search.stages)),
        stage_time_s=tuple(times),
        # the slowest rank group's syncs, and what of them its backward does not hide
        grad_sync_s=max(sum(sy for sy, g in zip(syncs, groups) if g == r) for r in range(search.num_stages)),
        exposed_grad_sync_s=max(search.exposed_syncs()),
        recompute=tuple(s.remat for s in search.stages),
        one_microbatch_unpipelined={key: unpipelined[key] for key in whole if key in unpipelined},
        optimizer_s=search.optimizer_s,
    )
    solver_info = dataclasses.replace(
        base.solver,
        stage_search={
            "ilp_solves": search.ilp_solves,
            "pipelines_priced": len(search.rows),
            "candidate_plans": len(mesh_costs.candidates),
        },
    )
    return dataclasses.replace(
        base,
        mesh_shape=tuple(search.mesh_shape),
        pipeline=pipeline,
        predicted=predicted,
        solver=solver_info,
        stats={**base.stats, "stage_search": search.rows, "stage_search_time_s": search.search_time_s},
    )
