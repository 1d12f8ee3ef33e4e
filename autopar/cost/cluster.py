"""What the cost model knows about the hardware: a ``ClusterSpec``.

A cluster is ``num_nodes`` nodes of ``devices_per_node`` identical devices. A device has a peak
FLOP rate per dtype, a memory bandwidth and a memory size. Two links connect devices: one inside
a node (NVLink, loopback) and one between nodes (InfiniBand, Ethernet), each an alpha-beta link
(``latency_s``, ``bandwidth_bytes_per_s``).

Which link a mesh axis uses (``ClusterSpec.axis_link``): ranks are laid out row-major over the
mesh, so the last mesh axis is innermost and rank ``r`` sits at the row-major position of ``r``;
ranks ``0 .. devices_per_node - 1`` share node 0, and so on. The ranks of one group on ``axis``
differ only in that axis's coordinate, and all of them lie in one block of
``prod(mesh_shape[axis:])`` consecutive ranks. When that block size divides ``devices_per_node``
(so it is at most a node and never straddles a node boundary) the axis uses ``intra_node``,
otherwise ``inter_node``: one network interface's link, times the interfaces a group crosses nodes
on (``ClusterSpec.network_lanes``: a group with ``g`` devices on each node of a machine with one
NIC per device uses ``g`` of them).

Specs come from JSON presets in ``presets/`` (``get_cluster("h100-80g")``), from a JSON or TOML
file, or (later) from ``autopar profile``. The numbers in the presets are approximate datasheet
values; each preset says where they come from in its ``source`` and ``notes`` fields.

**Ranks that share a host's compute.** On a GPU cluster every rank has a device of its own. On
a CPU machine every rank is a process running on the host's cores, and a mesh can start more
ranks on a node than it has cores (4 gloo ranks of one thread on 2 cores): the operating system
then time-slices them, and each rank computes at a share of a device's speed.
``compute_slots_per_node`` says how many ranks a node runs at full speed at once (a CPU node of
``C`` cores whose ranks run ``t`` threads each has ``C // t``; None, the default: every device
computes on its own). ``ClusterSpec.compute_share(mesh_shape)`` is then
``min(1, compute_slots_per_node / ranks on the node)``, where the mesh puts
``min(prod(mesh_shape), devices_per_node)`` ranks on a node, and the compute model divides every
op's time by it. The links slow down alike (``axis_link``: latency over the share, bandwidth
times it): gloo moves every message with the ranks' own CPU, and a rank that is not running does
not answer (on 2 cores, 4 ranks measured a per-step all-reduce latency 1.5-3× that of 2 ranks;
benchmarks/README.md). ``local_cluster()`` (what ``compile`` prices without a ``cluster``) is then the
"cpu-gloo" preset (gloo's links measured on one host) with the host's cores
(``os.sched_getaffinity``); offline, say it on a spec:
``dataclasses.replace(get_cluster("cpu-gloo"), compute_slots_per_node=2)`` or
``"compute_slots_per_node": 2`` in a cluster file. A pipeline's stages are priced on their stage
mesh, one of ``concurrent_meshes`` that run side by side: a node holds that many times a stage's
ranks (up to ``devices_per_node``), whose share is then the whole pipeline's.

Two more links price offload (``autopar.ir.memory``): ``host_link`` between a device and its host's
memory (PCIe), and ``disk_link`` between the host and local disk (NVMe). A spec without a
``host_link`` is one whose compute device *is* the host (the ``cpu`` preset): there, offload to
host memory saves nothing, and ``offload="auto"`` means disk.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import tomllib
import torch

from autopar.cost.rates import ComputeRates
from autopar.errors import ClusterSpecError, ConfigError, InternalError
from autopar.ir.units import parse_budget

PRESETS_DIR = Path(__file__).parent / "presets"
DEFAULT_PRESET = "h100-80g"
# What ``compile`` prices on a machine without CUDA: one host's CPU ranks over gloo (loopback),
# with figures measured there (``presets/cpu-gloo.json`` says how), and this host's cores.
CPU_PRESET = "cpu-gloo"
COMPUTE_MODES = ("roofline", "measured")
# What runs the rewritten graph: "eager" (op by op) or "inductor" (``compile(..., compiler=
# "inductor")``), whose fused pointwise kernels move fewer bytes (``cost.compute.executed_bytes``).
EXECUTORS = ("eager", "inductor")
# The default memory budget is the device's memory less this reserve (``ClusterSpec.memory_reserve_bytes``).
MEMORY_RESERVE_FRACTION = 0.10
MEMORY_RESERVE_MIN_BYTES = 2**30
# CUDA device names (``torch.cuda.get_device_name``) -> the preset that prices them, by substring.
_DEVICE_PRESETS = (("H100", "h100-80g"), ("H200", "h200-141g"), ("A100", "a100-40g"), ("V100", "v100-16g"))


def _positive_number(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ClusterSpecError(f"{owner}.{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ClusterSpecError(f"{owner}.{name} must be finite and > 0, got {value!r}")


def _positive_int(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ClusterSpecError(f"{owner}.{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """An alpha-beta link: sending ``n`` bytes once costs ``latency_s + n / bandwidth_bytes_per_s``.

    ``bandwidth_bytes_per_s`` is the effective bandwidth per device and per direction that a ring
    collective reaches (NCCL's "bus bandwidth"), not a marketing bidirectional total.
    """

    latency_s: float
    bandwidth_bytes_per_s: float

    def __post_init__(self) -> None:
        _positive_number("LinkSpec", "latency_s", self.latency_s)
        _positive_number("LinkSpec", "bandwidth_bytes_per_s", self.bandwidth_bytes_per_s)

    def to_json(self) -> dict[str, float]:
        return {"latency_s": self.latency_s, "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: str = "link") -> LinkSpec:
        if not isinstance(data, Mapping):
            raise ClusterSpecError(f"{where} must be a table with latency_s and bandwidth_bytes_per_s, got {data!r}")
        expected = {"latency_s", "bandwidth_bytes_per_s"}
        if set(data) != expected:
            raise ClusterSpecError(f"{where} has keys {sorted(data)}; expected exactly {sorted(expected)}")
        return cls(latency_s=data["latency_s"], bandwidth_bytes_per_s=data["bandwidth_bytes_per_s"])


# One NVMe drive's sequential bandwidth (~2 GB/s), with a file system call's latency.
DEFAULT_DISK_LINK = LinkSpec(latency_s=1e-4, bandwidth_bytes_per_s=2e9)


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """Nodes of identical devices and the two links between them. Units: seconds, bytes, FLOP/s.

    ``peak_flops`` maps a torch dtype name (``"float32"``, ``"bfloat16"``, ``"float16"``) to the
    dense peak FLOP/s of one device in that dtype; ``"float32"`` is required and is the fallback
    for dtypes not listed. ``source`` and ``notes`` say where the numbers come from.
    """

    name: str
    devices_per_node: int
    num_nodes: int
    peak_flops: dict[str, float]
    memory_bandwidth_bytes_per_s: float
    memory_bytes: int
    intra_node: LinkSpec
    inter_node: LinkSpec
    source: str = field(default="", repr=False)
    notes: str = field(default="", repr=False)
    # How ops are priced: "roofline" (FLOPs and bytes against the peaks above) or "measured"
    # (timed on this machine's device and cached on disk; ``autopar.cost.measured``).
    compute: str = "roofline"
    # Device <-> host memory, per device and direction; None: the device is the host.
    host_link: LinkSpec | None = None
    # Host memory <-> local disk, per device (the NVMe bandwidth divided among the node's devices).
    disk_link: LinkSpec = field(default_factory=lambda: DEFAULT_DISK_LINK)
    # How many ranks a node runs at full speed at once (its CPU cores over threads per rank);
    # None: every device computes on its own (see the module docstring, ``compute_share``).
    compute_slots_per_node: int | None = None
    # How many meshes like the one priced run at once on the same nodes: a pipeline's stage
    # meshes (``ranks_per_node``: what shares a node's compute slots). 1 for a whole mesh.
    concurrent_meshes: int = 1
    # The executor the plan is priced for (``EXECUTORS``); compile sets it from its ``compiler``.
    executor: str = "eager"
    # What kernels reach of the peaks (``cost.rates``); None: the plain roofline against them.
    rates: ComputeRates | None = None
    # Host seconds DTensor's dispatch adds to one op whose arguments are DTensors, over the plain
    # op: torch's optimizer steps a plan's parameters as DTensors wherever one is not replicated
    # (``cost.optimizer.dtensor_dispatch_s``). 0: not measured for this machine.
    dtensor_op_s: float = 0.0
    # Network interfaces of a node that carry ``inter_node`` traffic, each at ``inter_node``'s
    # bandwidth (DGX/HGX nodes: one per GPU). A group with several devices on a node crosses
    # nodes on their share of them (``axis_link``); 1: a node's traffic on one such link.
    nics_per_node: int = 1

    @property
    def gloo(self) -> bool:
        """Whether the devices are host processes that talk over gloo: a cluster with no
        ``host_link`` (the device is the host), as the "cpu" and "cpu-gloo" presets say. Its
        reduce-scatters run as an all-to-all and a local sum (``ops.collectives``), which hold a
        second buffer of the input's size until their wait (``cost.liveness``)."""
        return self.host_link is None

    def __post_init__(self) -> None:
        owner = f"ClusterSpec {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ClusterSpecError(f"ClusterSpec.name must be a non-empty string, got {self.name!r}")
        _positive_int(owner, "devices_per_node", self.devices_per_node)
        _positive_int(owner, "num_nodes", self.num_nodes)
        if not isinstance(self.peak_flops, Mapping) or "float32" not in self.peak_flops:
            raise ClusterSpecError(
                f"{owner}: peak_flops must map dtype names to FLOP/s and include 'float32', got {self.peak_flops!r}"
            )
        for dtype_name, value in self.peak_flops.items():
            if not isinstance(getattr(torch, str(dtype_name), None), torch.dtype):
                raise ClusterSpecError(
                    f"{owner}: peak_flops key {dtype_name!r} is not a torch dtype name "
                    f"(expected e.g. 'float32', 'bfloat16', 'float16')"
                )
            _positive_number(owner, f"peak_flops[{dtype_name!r}]", value)
        # A private copy, so that the caller's dict cannot change a frozen spec.
        object.__setattr__(self, "peak_flops", {str(k): float(v) for k, v in self.peak_flops.items()})
        _positive_number(owner, "memory_bandwidth_bytes_per_s", self.memory_bandwidth_bytes_per_s)
        _positive_int(owner, "memory_bytes", self.memory_bytes)
        for name in ("intra_node", "inter_node"):
            if not isinstance(getattr(self, name), LinkSpec):
                raise ClusterSpecError(f"{owner}.{name} must be a LinkSpec, got {getattr(self, name)!r}")
        if self.host_link is not None and not isinstance(self.host_link, LinkSpec):
            raise ClusterSpecError(f"{owner}.host_link must be a LinkSpec or None, got {self.host_link!r}")
        if not isinstance(self.disk_link, LinkSpec):
            raise ClusterSpecError(f"{owner}.disk_link must be a LinkSpec, got {self.disk_link!r}")
        if self.compute_slots_per_node is not None:
            _positive_int(owner, "compute_slots_per_node", self.compute_slots_per_node)
        _positive_int(owner, "concurrent_meshes", self.concurrent_meshes)
        _positive_int(owner, "nics_per_node", self.nics_per_node)
        if self.compute not in COMPUTE_MODES:
            raise ClusterSpecError(f"{owner}.compute must be one of {', '.join(COMPUTE_MODES)}, got {self.compute!r}")
        if self.rates is not None and not isinstance(self.rates, ComputeRates):
            raise ClusterSpecError(f"{owner}.rates must be a ComputeRates or None, got {self.rates!r}")
        dispatch = self.dtensor_op_s
        if isinstance(dispatch, bool) or not isinstance(dispatch, (int, float)) or not 0 <= dispatch < math.inf:
            raise ClusterSpecError(f"{owner}.dtensor_op_s must be a finite number >= 0, got {dispatch!r}")
        if self.executor not in EXECUTORS:
            raise ClusterSpecError(f"{owner}.executor must be one of {', '.join(EXECUTORS)}, got {self.executor!r}")
        for name in ("source", "notes"):
            if not isinstance(getattr(self, name), str):
                raise ClusterSpecError(f"{owner}.{name} must be a string, got {getattr(self, name)!r}")

    @property
    def num_devices(self) -> int:
        return self.devices_per_node * self.num_nodes

    @property
    def memory_reserve_bytes(self) -> int:
        """Device memory a plan leaves free: ``MEMORY_RESERVE_FRACTION`` of it, at least
        ``MEMORY_RESERVE_MIN_BYTES`` (and at most half, for toy clusters). It covers what the liveness walk does not model: the CUDA
        context, NCCL's buffers, kernel workspace (cuBLAS, attention) and the caching
        allocator's fragmentation."""
        return min(self.memory_bytes // 2, max(MEMORY_RESERVE_MIN_BYTES, int(self.memory_bytes * MEMORY_RESERVE_FRACTION)))

    @property
    def default_memory_budget(self) -> int:
        """Bytes per device a plan may use when no ``memory_budget`` is given."""
        return self.memory_bytes - self.memory_reserve_bytes

    def ranks_per_node(self, mesh_shape: Sequence[int]) -> int:
        """Ranks a mesh puts on one node: its size (times ``concurrent_meshes``: a pipeline's stages
        side by side), up to ``devices_per_node`` (row-major fill)."""
        return min(math.prod(mesh_shape) * self.concurrent_meshes, self.devices_per_node)

    def compute_share(self, mesh_shape: Sequence[int]) -> float:
        """The fraction of a device's compute each rank of ``mesh_shape`` gets:
        ``min(1, compute_slots_per_node / ranks_per_node(mesh_shape))``, 1 without slots."""
        if self.compute_slots_per_node is None:
            return 1.0
        return min(1.0, self.compute_slots_per_node / self.ranks_per_node(mesh_shape))

    def peak_flops_for(self, dtype: torch.dtype) -> float:
        """Peak FLOP/s in ``dtype``, or the float32 peak where the dtype is not listed."""
        return self.peak_flops.get(str(dtype).removeprefix("torch."), self.peak_flops["float32"])

    def axis_link(self, mesh_shape: Sequence[int], axis: int) -> LinkSpec:
        """The link that collectives on mesh axis ``axis`` run over (see the module docstring).

        The group block is ``prod(mesh_shape[axis:])`` consecutive ranks (the last axis is
        innermost). It is ``intra_node`` when the block divides ``devices_per_node``, so that every
        group lies inside one node, and ``inter_node`` otherwise, at the bandwidth of as many
        network interfaces as the group crosses nodes on (``network_lanes``), up to ``intra_node``'s.
        Where the mesh's ranks share a node's compute (``compute_share`` < 1), the link runs at that
        share too: latency divided by it, bandwidth multiplied by it.
        """
        if not 0 <= axis < len(mesh_shape):
            raise InternalError(f"mesh axis {axis} out of range for mesh {tuple(mesh_shape)}")
        block = math.prod(mesh_shape[axis:])
        link = self.intra_node if self.devices_per_node % block == 0 else self.inter_node
        lanes = self.network_lanes(mesh_shape, axis) if link is self.inter_node else 1.0
        if lanes > 1:
            bandwidth = min(link.bandwidth_bytes_per_s * lanes, self.intra_node.bandwidth_bytes_per_s)
            link = LinkSpec(link.latency_s, max(bandwidth, link.bandwidth_bytes_per_s))
        share = self.compute_share(mesh_shape)
        if share < 1:  # time-sliced ranks also share the CPU that moves their messages
            return LinkSpec(link.latency_s / share, link.bandwidth_bytes_per_s * share)
        return link

    def network_lanes(self, mesh_shape: Sequence[int], axis: int) -> float:
        """How many network interfaces' bandwidth one group of mesh axis ``axis`` crosses nodes
        with: its members on one node (``mesh_shape[axis]`` ranks, ``prod(mesh_shape[axis + 1:])``
        apart) times the node's interfaces per device, at least one. NCCL runs a channel per
        interface near the group's devices, so a group of a node's 8 GPUs crosses nodes on all 8
        NICs of a DGX H100 (all-reduce bus bandwidth across such nodes: 400-450 GB/s, eight
        400 Gb/s NICs), where the groups of an axis with one device per node share a node's
        interfaces one each."""
        stride = math.prod(mesh_shape[axis + 1 :])
        on_node = max(1, min(mesh_shape[axis], self.devices_per_node // stride))
        return max(1.0, on_node * self.nics_per_node / self.devices_per_node)

    # ---------------------------------------------------------------------------------------
    # Serialization: a flat JSON object (or TOML document) whose links are sub-tables.

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict; ``ClusterSpec.from_json(spec.to_json()) == spec``."""
        return {
            "name": self.name,
            "devices_per_node": self.devices_per_node,
            "num_nodes": self.num_nodes,
            "peak_flops": dict(self.peak_flops),
            "memory_bandwidth_bytes_per_s": self.memory_bandwidth_bytes_per_s,
            "memory_bytes": self.memory_bytes,
            "intra_node": self.intra_node.to_json(),
            "inter_node": self.inter_node.to_json(),
            "source": self.source,
            "notes": self.notes,
            **({"compute": self.compute} if self.compute != "roofline" else {}),
            **({"host_link": self.host_link.to_json()} if self.host_link is not None else {}),
            **({"disk_link": self.disk_link.to_json()} if self.disk_link != DEFAULT_DISK_LINK else {}),
            **({"compute_slots_per_node": self.compute_slots_per_node} if self.compute_slots_per_node is not None else {}),
            **({"concurrent_meshes": self.concurrent_meshes} if self.concurrent_meshes != 1 else {}),
            **({"executor": self.executor} if self.executor != "eager" else {}),
            **({"rates": self.rates.to_json()} if self.rates is not None else {}),
            **({"dtensor_op_s": self.dtensor_op_s} if self.dtensor_op_s else {}),
            **({"nics_per_node": self.nics_per_node} if self.nics_per_node != 1 else {}),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | str) -> ClusterSpec:
        """Build from a dict (as ``to_json`` returns) or from a JSON string."""
        if isinstance(data, str):
            data = json.loads(data)
        if not isinstance(data, Mapping):
            raise ClusterSpecError(f"a cluster spec must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        required = known - {
            "source",
            "notes",
            "compute",
            "host_link",
            "disk_link",
            "compute_slots_per_node",
            "concurrent_meshes",
            "executor",
            "rates",
            "dtensor_op_s",
            "nics_per_node",
        }
        unknown = set(data) - known
        missing = required - set(data)
        if unknown or missing:
            raise ClusterSpecError(
                f"cluster spec {data.get('name', '?')!r}: unknown keys {sorted(unknown)}, "
                f"missing keys {sorted(missing)}; expected {sorted(known)}"
            )
        kwargs = dict(data)
        kwargs["intra_node"] = LinkSpec.from_json(data["intra_node"], "intra_node")
        kwargs["inter_node"] = LinkSpec.from_json(data["inter_node"], "inter_node")
        if "host_link" in data:
            kwargs["host_link"] = LinkSpec.from_json(data["host_link"], "host_link")
        if "disk_link" in data:
            kwargs["disk_link"] = LinkSpec.from_json(data["disk_link"], "disk_link")
        if "rates" in data:
            kwargs["rates"] = ComputeRates.from_json(data["rates"], "rates")
        return cls(**kwargs)

    def save(self, path: str | os.PathLike) -> None:
        """Write JSON, or TOML when ``path`` ends in ``.toml``."""
        path = Path(path)
        if path.suffix == ".toml":
            path.write_text(_to_toml(self.to_json()))
        else:
            path.write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> ClusterSpec:
        """Read JSON, or TOML when ``path`` ends in ``.toml``."""
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text()) if path.suffix == ".toml" else json.loads(path.read_text())
        except (json.JSONDecodeError, tomllib.TOMLDecodeError) as err:
            raise ClusterSpecError(
                f"cannot parse cluster spec {str(path)!r}: {err}; fix its syntax, or write it again with `autopar profile`"
            ) from err
        try:
            return cls.from_json(data)
        except (ValueError, TypeError) as err:
            raise ClusterSpecError(
                f"invalid cluster spec in {str(path)!r}: {err}; fix that field, or write the file again with `autopar profile`"
            ) from err


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string for our text
    raise InternalError(f"cannot write {value!r} to TOML")


def _to_toml(data: Mapping[str, Any]) -> str:
    """TOML for a dict of scalars and one level of sub-tables (all a ClusterSpec needs)."""
    lines = [f"{key} = {_toml_value(v)}" for key, v in data.items() if not isinstance(v, Mapping)]
    for key, table in data.items():
        if isinstance(table, Mapping):
            lines += ["", f"[{key}]"] + [f"{json.dumps(k)} = {_toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


def get_cluster(spec: str | ClusterSpec | os.PathLike | None = None) -> ClusterSpec:
    """A ``ClusterSpec`` from a spec, a preset name, or a JSON/TOML file; None gives "h100-80g"."""
    if spec is None:
        spec = DEFAULT_PRESET
    if isinstance(spec, ClusterSpec):
        return spec
    if isinstance(spec, str) and (PRESETS_DIR / f"{spec}.json").is_file():
        return ClusterSpec.load(PRESETS_DIR / f"{spec}.json")
    path = Path(spec)
    if path.suffix in (".json", ".toml") or isinstance(spec, os.PathLike):
        if not path.is_file():
            raise ClusterSpecError(
                f"cluster spec file {str(path)!r} does not exist: pass an existing file, a preset name "
                f"({', '.join(preset_names())}), or write one with `autopar profile --out {path.name}`"
            )
        return ClusterSpec.load(path)
    raise ClusterSpecError(
        f"unknown cluster {spec!r}: expected a preset name ({', '.join(preset_names())}), a .json or .toml file, or a "
        "ClusterSpec; pass one of the presets, or measure this machine into a file with `autopar profile --out cluster.json`"
    )


def resolve_budget(memory_budget: float | str | None, cluster: ClusterSpec) -> float | None:
    """Bytes per device a plan may use: None means the cluster's device memory less its reserve
    (``ClusterSpec.default_memory_budget``), ``float("inf")`` no budget (returned as None)."""
    memory_budget = parse_budget(memory_budget)  # "80GB" as the CLI takes it
    if memory_budget is None:
        return float(cluster.default_memory_budget)
    if memory_budget == float("inf"):
        return None
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float)) or not memory_budget > 0:
        raise ConfigError(
            f"memory_budget is bytes per device and must be positive (or float('inf') for none), got {memory_budget!r}"
        )
    return float(memory_budget)


def host_cores() -> int:
    """CPU cores this process may run on (its affinity mask, which containers and ``taskset``
    narrow), or ``os.cpu_count()`` where the platform has no affinity."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def cpu_cluster(threads_per_rank: int | None = None, cores: int | None = None) -> ClusterSpec:
    """The "cpu-gloo" preset (``CPU_PRESET``) for this host: ``compute_slots_per_node`` is its
    cores (``host_cores``) over the threads each rank runs (``torch.get_num_threads()`` by
    default, which is a rank's own count when called in a rank: torchrun and ``run_distributed``
    give each one thread)."""
    threads = threads_per_rank if threads_per_rank is not None else torch.get_num_threads()
    _positive_int("cpu_cluster", "threads_per_rank", threads)
    cores = cores if cores is not None else host_cores()
    _positive_int("cpu_cluster", "cores", cores)
    slots = max(1, cores // threads)
    return dataclasses.replace(get_cluster(CPU_PRESET), name=f"{CPU_PRESET} ({slots} slots)", compute_slots_per_node=slots)


def local_cluster() -> ClusterSpec:
    """The spec of the machine this runs on: the preset of its CUDA device (by name; the
    device's own memory when it differs from the preset's), or without one the "cpu-gloo"
    preset with this host's compute slots (``cpu_cluster``: ranks beyond its cores share them)."""
    if not torch.cuda.is_available():
        return cpu_cluster()
    name = torch.cuda.get_device_name()
    for needle, preset in _DEVICE_PRESETS:
        if needle in name:
            spec = get_cluster(preset)
            memory = torch.cuda.get_device_properties(0).total_memory
            if memory != spec.memory_bytes:
                spec = dataclasses.replace(spec, memory_bytes=memory, name=f"{spec.name} ({name})")
            return spec
    raise ClusterSpecError(
        f"no cluster preset prices the CUDA device {name!r}: pass cluster= a preset "
        f"({', '.join(preset_names())}), a ClusterSpec, or a file from `autopar profile`"
    )


__all__ = [
    "LinkSpec",
    "ClusterSpec",
    "get_cluster",
    "local_cluster",
    "cpu_cluster",
    "host_cores",
    "CPU_PRESET",
    "resolve_budget",
    "preset_names",
    "PRESETS_DIR",
    "DEFAULT_PRESET",
    "MEMORY_RESERVE_FRACTION",
    "MEMORY_RESERVE_MIN_BYTES",
]
