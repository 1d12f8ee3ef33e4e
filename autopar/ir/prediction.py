"""What a plan predicts (``Prediction``) and how its solver got there (``SolverStats``).

Both are the plan's ``predicted`` and ``solver`` JSON objects as frozen values: ``to_json``
writes the keys a planner recorded, in the order autopar has always written them, so that plan
files stay byte-identical; ``from_json`` reads them back, keeping keys it does not know in
``extra``. docs/plan-format.md gives each key's meaning.

Reading them as dicts (``plan.predicted["step_time_s"]``, ``.get``, ``in``) still works for now,
with a ``DeprecationWarning``: read the attribute (``plan.predicted.step_time_s``), or
``to_json()`` for the whole object.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class _KeyAccess:
    """Deprecated dict-style reads of a JSON-backed value, for code written when it was a dict."""

    __slots__ = ()

    def to_json(self) -> dict[str, Any]:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def _warn(self, key: object) -> None:
        warnings.warn(
            f"{type(self).__name__} is a frozen dataclass, not a dict: read .{key} (or .to_json()[{key!r}]) "
            "instead of [...], .get() or `in`; dict-style reads will be removed",
            DeprecationWarning,
            stacklevel=3,
        )

    def __getitem__(self, key: str) -> Any:
        self._warn(key)
        return self.to_json()[key]

    def get(self, key: str, default: Any = None) -> Any:
        self._warn(key)
        return self.to_json().get(key, default)

    def __contains__(self, key: object) -> bool:
        self._warn(key)
        return key in self.to_json()


def _tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


# The order of ``predicted`` keys as the planners write them: a sharded plan's (solver.planners.
# sharding, then its memory decisions, the executor and the symbolic costs of ``autopar.plan``), and a
# pipelined plan's (solver.planners.stages), whose leading keys come first.
_SHARDED_ORDER = (
    "step_time_s",
    "compute_s",
    "reshard_s",
    "grad_sync_s",
    "exposed_grad_sync_s",
    "grad_schedule",
    "peak_memory_bytes",
    "peak_memory_at",
    "memory_at_peak_bytes",
    "allocator_peak_bytes",
    "comm_bytes",
    "comm_bytes_per_axis",
    "expert_parallel",
    "memory_s",
    "optimizer_s",
    "executor",
    "symbolic",
)
_PIPELINED_ORDER = ("step_time_s", "peak_memory_bytes", "stage_time_s", "grad_sync_s", "recompute", "one_microbatch_unpipelined")


@dataclass(frozen=True, slots=True)
class Prediction(_KeyAccess):
    """The plan's predicted costs of one training step, per device. A field left None was not
    predicted (it is absent from the JSON): a pipelined plan has no ``compute_s``, a sharded one
    no ``stage_time_s``. Units are in the names; docs/plan-format.md says what each counts."""

    step_time_s: float | None = None
    compute_s: float | None = None
    reshard_s: float | None = None
    grad_sync_s: float | None = None
    exposed_grad_sync_s: float | None = None
    # delta_s, delta_bytes, last_bucket_s, post_solve_s (solver.pricing.comm_schedule); overlap_s (gather_overlap)
    grad_schedule: Mapping[str, float] | None = None
    peak_memory_bytes: int | None = None
    peak_memory_at: str | None = None  # "forward after NODE" or "backward of NODE"
    memory_at_peak_bytes: Mapping[str, int] | None = None  # the peak by kind
    # the caching allocator's peaks over steady-state steps: allocated, reserved (default
    # allocator), reserved_expandable (expandable segments); solver.pricing.reserved
    allocator_peak_bytes: Mapping[str, int] | None = None
    comm_bytes: int | None = None
    comm_bytes_per_axis: tuple[int, ...] | None = None
    expert_parallel: tuple[Mapping[str, Any], ...] | None = None  # one record per experts op split by rank
    memory_s: float | None = None  # seconds the memory decisions add (``Plan.memory``)
    optimizer_s: float | None = None  # the AdamW step's seconds, in step_time_s (``cost.optimizer``)
    executor: str | None = None  # "eager" or "inductor": what the plan is priced for
    symbolic: Mapping[str, Any] | None = None  # costs as sympy expressions in the batch (``Plan.predict``)
    # Pipelined plans (solver.planners.stages):
    stage_time_s: tuple[float, ...] | None = None  # each stage's seconds per microbatch
    recompute: tuple[bool, ...] | None = None  # whether each stage recomputes its activations
    one_microbatch_unpipelined: Mapping[str, Any] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)  # keys this autopar does not know, as read

    def __post_init__(self) -> None:
        for name in ("comm_bytes_per_axis", "expert_parallel", "stage_time_s", "recompute"):
            object.__setattr__(self, name, _tuple(getattr(self, name)))

    @property
    def pipelined(self) -> bool:
        return self.stage_time_s is not None

    def to_json(self) -> dict[str, Any]:
        order = _PIPELINED_ORDER + _SHARDED_ORDER if self.pipelined else _SHARDED_ORDER
        out: dict[str, Any] = {}
        for name in order:
            value = getattr(self, name)
            if value is not None and name not in out:
                out[name] = list(value) if isinstance(value, tuple) else value
        return {**out, **self.extra}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Prediction:
        known = {name: value for name, value in data.items() if name in _FIELDS[cls] and name != "extra"}
        return cls(**known, extra={name: value for name, value in data.items() if name not in known})


@dataclass(frozen=True, slots=True)
class SolverStats(_KeyAccess):
    """How the ILP solve that made a plan went. ``status`` is the solver's ("Optimal", ...);
    ``objective_s`` its objective; ``memory_budget_bytes`` the budget it planned under (None:
    none); ``fallbacks`` the nodes no rule covered; ``method`` and ``backend`` how it was solved
    (solver.search); ``lower_bound_s`` and ``gap`` the proven bound where one is known;
    ``stage_search`` the stage planner's counts, in pipelined plans. Every field at its default is
    a plan made without a solve, whose JSON object is empty; otherwise the JSON holds every key
    but ``stage_search`` (null where unknown), as the planners write it."""

    status: str = ""
    objective_s: float | None = None
    num_variables: int | None = None
    num_constraints: int | None = None
    memory_budget_bytes: float | None = None
    fallbacks: tuple[str, ...] = ()
    method: str | None = None
    backend: str | None = None
    lower_bound_s: float | None = None
    gap: float | None = None
    stage_search: Mapping[str, int] | None = None  # ilp_solves, pipelines_priced, candidate_plans
    extra: Mapping[str, Any] = field(default_factory=dict)  # keys this autopar does not know, as read

    def __post_init__(self) -> None:
        object.__setattr__(self, "fallbacks", tuple(self.fallbacks))

    def to_json(self) -> dict[str, Any]:
        if self == SolverStats(extra=self.extra):  # no solve recorded
            return dict(self.extra)
        out = {
            "status": self.status,
            "objective_s": self.objective_s,
            "num_variables": self.num_variables,
            "num_constraints": self.num_constraints,
            "memory_budget_bytes": self.memory_budget_bytes,
            "fallbacks": list(self.fallbacks),
            "method": self.method,
            "backend": self.backend,
            "lower_bound_s": self.lower_bound_s,
            "gap": self.gap,
        }
        if self.stage_search is not None:
            out["stage_search"] = self.stage_search
        return {**out, **self.extra}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SolverStats:
        known = {name: value for name, value in data.items() if name in _FIELDS[cls] and name != "extra"}
        return cls(**known, extra={name: value for name, value in data.items() if name not in known})


_FIELDS = {kind: frozenset(f.name for f in dataclasses.fields(kind)) for kind in (Prediction, SolverStats)}
