"""How a compiled module takes its data: the same whole batch on every rank, or each data-parallel
rank's own rows (the way DDP scripts load data, with a ``DistributedSampler``).

``DataOptions`` is what the user asks for; ``DataLayout`` is what a plan records: the mode and
the mesh axes that split the batch (dim 0 of every batched input), in mesh order. The ranks'
data-parallel rank is their position on those axes, row-major (the first axis outermost), which
is the order in which ``Shard(0)`` on several axes lays out the rows: rank ``k`` of
``data_parallel_size`` holds rows ``[k * B / n, (k + 1) * B / n)`` of the global batch ``B``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from autopar.errors import ConfigError, PlanError

BATCH_MODES = ("whole", "per_rank")


@dataclass(frozen=True, slots=True)
class DataOptions:
    """``batch="whole"`` (the default): every rank passes the same whole batch, which the plan
    cuts; a mismatch between ranks is an error. ``batch="per_rank"``: each rank passes only its
    own rows, ``B / pm.data_parallel_size`` of the global batch ``B`` of the example inputs, as
    a ``DistributedSampler(num_replicas=pm.data_parallel_size, rank=pm.data_parallel_rank)``
    gives them; ranks of one data-parallel rank pass the same rows."""

    batch: str = "whole"

    def __post_init__(self) -> None:
        if self.batch not in BATCH_MODES:
            raise ConfigError(
                f"batch must be one of {BATCH_MODES}, got {self.batch!r}: 'whole' when every rank passes the same "
                "whole batch, 'per_rank' when each data-parallel rank passes its own rows (a DistributedSampler's)"
            )

    @property
    def per_rank(self) -> bool:
        return self.batch == "per_rank"


@dataclass(frozen=True, slots=True)
class DataLayout:
    """A plan's data layout: the batch mode, the mesh axes that split the batch (dim 0 of the
    user inputs in ``inputs``, whose dim 0 is the batch), and the mesh."""

    batch: str
    axes: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    inputs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        DataOptions(self.batch)
        if list(self.axes) != sorted(set(self.axes)) or any(not 0 <= a < len(self.mesh_shape) for a in self.axes):
            raise PlanError(
                f"data-parallel axes must be distinct mesh axes in order, got {self.axes} for mesh {self.mesh_shape}: re-plan"
            )

    @property
    def per_rank(self) -> bool:
        return self.batch == "per_rank"

    @property
    def size(self) -> int:
        """The number of data-parallel ranks: the product of the batch-splitting axes' sizes."""
        return math.prod(self.mesh_shape[a] for a in self.axes)

    def rank(self, coordinate: tuple[int, ...]) -> int:
        """The data-parallel rank of the rank at mesh ``coordinate``."""
        rank = 0
        for axis in self.axes:
            rank = rank * self.mesh_shape[axis] + coordinate[axis]
        return rank

    def to_json(self) -> dict[str, Any]:
        return {"batch": self.batch, "axes": list(self.axes), "inputs": list(self.inputs), "data_parallel_size": self.size}

    @classmethod
    def from_json(cls, data: dict[str, Any], mesh_shape: tuple[int, ...]) -> DataLayout:
        return cls(data["batch"], tuple(int(a) for a in data["axes"]), tuple(mesh_shape), tuple(data.get("inputs", ())))

    def describe(self) -> str:
        axes = ", ".join(str(a) for a in self.axes) or "none"
        how = "each data-parallel rank passes its own rows" if self.per_rank else "every rank passes the same whole batch"
        return f"data: batch={self.batch!r} ({how}); batch split on mesh axes {axes}: data_parallel_size {self.size}"
