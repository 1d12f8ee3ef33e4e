"""``autopar profile``: measure this machine and write a ``ClusterSpec``.

Two measurements:

* **The device roofline** (``measure_device``): dense matmul FLOP/s per dtype (square matmuls,
  best of a few timed runs after warm-up; float32 always, bfloat16 and float16 on CUDA), memory
  bandwidth (a large tensor copied: read + write bytes over time) and memory size. On CUDA every
  timing is bracketed by ``torch.cuda.synchronize``. On CPU the "device" is one process with the
  threads it has (``run_distributed`` and ``--spawn`` give each rank one thread, as the gloo runs
  that the cpu preset describes do), and the spec's ``compute_slots_per_node`` is the host's
  cores over a rank's threads (``cost.cluster.cpu_cluster``): ranks beyond it share cores.
* **The alpha-beta of each mesh axis** (``measure_axes``), on a live process group: timed ring
  all-reduces of a few sizes on that axis's groups (the slowest rank's median time per size),
  fitted by least squares to ``t = 2(k-1)·α + 2(k-1)/k · bytes/β`` (``fit_alpha_beta``). An
  axis whose groups fit inside a node (``ClusterSpec.axis_link``) gives the ``intra_node``
  link, otherwise ``inter_node``; a link no axis measured copies the other and says so in
  ``notes``. Without a process group the links are the base preset's, and ``notes`` says so.
  Where more ranks ran than the host has compute slots, each measured link is scaled back to full
  speed by the ranks' ``compute_share`` (``ClusterSpec.axis_link`` applies it again when pricing).

The CLI (``python -m autopar profile --out cluster.json [--mesh 2x2 --spawn]``) runs under
torchrun (every rank measures; rank 0 writes), with ``--spawn`` (local gloo ranks), or alone
(the device only).
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from autopar.cost.cluster import CPU_PRESET, ClusterSpec, LinkSpec, cpu_cluster, get_cluster, local_cluster
from autopar.errors import ClusterSpecError, ConfigError, InternalError, MeshError
from autopar.runtime.module import mesh_groups
from autopar.runtime.tools import profile_rates
from autopar.runtime.tools.launch import run_distributed
from autopar.runtime.tools.profile_rates import time_call

QUICK_ALLREDUCE_BYTES = (4 << 10, 64 << 10, 1 << 20, 4 << 20)
FULL_ALLREDUCE_BYTES = (4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20)


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, size: int, repeats: int = 5) -> float:
    """FLOP/s of a ``size``×``size`` matmul in ``dtype`` (2·size³ FLOPs), the best of ``repeats``."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    seconds = min(time_call(lambda: torch.mm(a, b), device, repeats=1, warmup=1 if i else 2) for i in range(repeats))
    return 2.0 * size**3 / seconds


def measure_memory_bandwidth(device: torch.device, num_bytes: int, repeats: int = 5) -> float:
    """Bytes/s of copying a ``num_bytes`` float32 tensor (``2·num_bytes`` moved), the best run."""
    src = torch.empty(num_bytes // 4, device=device).uniform_()
    dst = torch.empty_like(src)
    seconds = min(time_call(lambda: dst.copy_(src), device, repeats=1, warmup=1) for _ in range(repeats))
    return 2.0 * src.numel() * 4 / seconds


def device_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu-{torch.get_num_threads()}thread"


def measure_device(device: torch.device | str | None = None, quick: bool = False, rates: bool | None = None) -> dict[str, Any]:
    """The roofline of ``device`` (default: CUDA when available, else CPU), as ClusterSpec fields;
    on CUDA (or with ``rates=True``) also its achieved rates and, on CUDA, its host link
    (``runtime.tools.profile_rates``)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        size, copy_bytes = (4096, 256 << 20) if quick else (8192, 1 << 30)
        dtypes = (torch.float32, torch.bfloat16, torch.float16)
    else:
        size, copy_bytes = (384, 32 << 20) if quick else (1024, 256 << 20)
        dtypes = (torch.float32,)  # CPU half-precision matmuls are emulated; the fp32 peak is the fallback
    peak_flops = {str(d).removeprefix("torch."): measure_matmul_flops(device, d, size) for d in dtypes}
    measured = {
        "device": device_name(device),
        "peak_flops": peak_flops,
        "memory_bandwidth_bytes_per_s": measure_memory_bandwidth(device, copy_bytes),
        "memory_bytes": device_memory_bytes(device),
    }
    if device.type == "cuda" if rates is None else rates:
        measured.update(_rates_and_host_link(device, measured, quick))
    return measured


def _rates_and_host_link(device: torch.device, measured: dict[str, Any], quick: bool) -> dict[str, Any]:
    """``ClusterSpec.rates`` in the dtype that training computes in (bf16 on CUDA), and on CUDA
    ``host_link``: a CPU device is its own host, which a spec says by having none."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    peak = measured["peak_flops"][str(dtype).removeprefix("torch.")]
    out: dict[str, Any] = {
        "rates": profile_rates.measure_rates(device, dtype, peak, measured["memory_bandwidth_bytes_per_s"], quick)
    }
    if device.type == "cuda":
        out["host_link"] = profile_rates.measure_host_link(device, profile_rates.host_link_sizes(device, quick))["link"]
    return out


def fit_alpha_beta(sizes_bytes: Sequence[float], times_s: Sequence[float], k: int) -> LinkSpec:
    """Least-squares fit of ring all-reduce times ``t = 2(k-1)·α + 2(k-1)/k · n/β``.

    A fitted intercept below 1 µs·2(k-1) is taken as 1 µs per step (noise can make it
    negative); a non-positive slope means the sizes were too small to see the bandwidth.
    """
    if k < 2 or len(sizes_bytes) != len(times_s) or len(sizes_bytes) < 2:
        raise InternalError(f"fit_alpha_beta needs k >= 2 and two or more (size, time) pairs, got k={k}, {len(times_s)} times")
    mean_n = statistics.fmean(sizes_bytes)
    mean_t = statistics.fmean(times_s)
    var = sum((n - mean_n) ** 2 for n in sizes_bytes)
    slope = sum((n - mean_n) * (t - mean_t) for n, t in zip(sizes_bytes, times_s)) / var
    if slope <= 0:
        raise ClusterSpecError(
            f"all-reduce times {list(times_s)} do not grow with size {list(sizes_bytes)}: measure larger sizes (drop --quick)"
        )
    intercept = mean_t - slope * mean_n
    latency_s = max(intercept / (2 * (k - 1)), 1e-6)
    bandwidth = 2 * (k - 1) / k / slope
    return LinkSpec(latency_s=latency_s, bandwidth_bytes_per_s=bandwidth)


def _time_all_reduces(sizes_bytes: Sequence[int], group: Any, device: torch.device, repeats: int) -> list[float]:
    """The slowest rank's median seconds for an all-reduce of each of ``sizes_bytes`` on ``group``,
    timed in rounds over the sizes: a burst of load on a shared host slows one round of every
    size, not every repeat of one size (which made times fall with size and the fit fail)."""
    tensors = [torch.ones(max(n // 4, 1), device=device) for n in sizes_bytes]
    for x in tensors:  # warm-up
        time_call(lambda x=x: dist.all_reduce(x, group=group), device, repeats=1, warmup=1)
    dist.barrier()
    rounds = [
        [time_call(lambda x=x: dist.all_reduce(x, group=group), device, repeats=1, warmup=0) for x in tensors]
        for _ in range(repeats)
    ]
    medians = [statistics.median(times[i] for times in rounds) for i in range(len(tensors))]
    slowest = torch.tensor(medians, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return [float(t) for t in slowest.tolist()]


def _fitted_axis(sizes_bytes: Sequence[int], group: Any, device: torch.device, repeats: int, size: int):
    """(times, fitted link) of one mesh axis; measured once more where the times do not grow with
    size (every rank sees the slowest rank's times, so all retry or none do)."""
    times = _time_all_reduces(sizes_bytes, group, device, repeats)
    try:
        return times, fit_alpha_beta(sizes_bytes, times, size)
    except ClusterSpecError:
        times = _time_all_reduces(sizes_bytes, group, device, repeats)
        return times, fit_alpha_beta(sizes_bytes, times, size)


def measure_axes(
    mesh_shape: Sequence[int], sizes_bytes: Sequence[int] = QUICK_ALLREDUCE_BYTES, repeats: int = 5
) -> list[dict[str, Any]]:
    """Per mesh axis: its size, the all-reduce timings, and the fitted link (None for size 1).

    Every rank of an initialized process group whose world size is ``prod(mesh_shape)`` must call
    it; all ranks return the same list."""
    if math.prod(mesh_shape) != dist.get_world_size():
        raise MeshError(
            f"mesh {tuple(mesh_shape)} has {math.prod(mesh_shape)} devices but the world size is "
            f"{dist.get_world_size()}: pass a mesh whose sizes multiply to the world size"
        )
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    names, _ = mesh_groups(tuple(mesh_shape))
    out = []
    for axis, (size, name) in enumerate(zip(mesh_shape, names)):
        if size == 1:
            out.append({"axis": axis, "size": size, "times_s": [], "link": None})
            continue
        times, link = _fitted_axis(sizes_bytes, _resolve_process_group(name), device, repeats, size)
        out.append({"axis": axis, "size": size, "sizes_bytes": list(sizes_bytes), "times_s": times, "link": link})
    return out


def build_spec(
    device: dict[str, Any],
    axes: list[dict[str, Any]] | None,
    mesh_shape: Sequence[int],
    devices_per_node: int,
    num_nodes: int,
    base: str = CPU_PRESET,
    name: str | None = None,
    compute_slots_per_node: int | None = None,
) -> ClusterSpec:
    """A ClusterSpec from ``measure_device``'s roofline and ``measure_axes``' links;
    ``compute_slots_per_node`` is how many of its ranks a node runs at once (None: each has a device)."""
    fallback = get_cluster(base)
    links: dict[str, list[LinkSpec]] = {"intra_node": [], "inter_node": []}
    probe = ClusterSpec(
        name="probe",
        devices_per_node=devices_per_node,
        num_nodes=num_nodes,
        peak_flops={"float32": 1.0},
        memory_bandwidth_bytes_per_s=1.0,
        memory_bytes=1,
        intra_node=fallback.intra_node,
        inter_node=fallback.inter_node,
    )
    # Ranks beyond the compute slots ran time-sliced: the spec holds the link at full speed, and
    # ``ClusterSpec.axis_link`` slows it down again for a mesh that shares the host.
    share = dataclasses.replace(probe, compute_slots_per_node=compute_slots_per_node).compute_share(mesh_shape)
    for entry in axes or []:
        if entry["link"] is None:
            continue
        level = "intra_node" if probe.axis_link(mesh_shape, entry["axis"]) is probe.intra_node else "inter_node"
        link = entry["link"]
        links[level].append(LinkSpec(link.latency_s * share, link.bandwidth_bytes_per_s / share))
    notes = [f"Measured by autopar profile on {device['device']} with torch {torch.__version__}."]
    if share < 1:
        notes.append(
            f"{math.prod(mesh_shape)} ranks shared {compute_slots_per_node} compute slots: the "
            f"links are the measured ones at full speed (latency x {share:g}, bandwidth / {share:g})."
        )
    if device.get("host_link") is not None:
        notes.append("host_link: pinned host-to-device and device-to-host copies, the slower direction.")
    if device.get("rates") is not None:
        notes.append("rates: measured (rates.source).")
    chosen: dict[str, LinkSpec] = {}
    for level, found in links.items():
        if found:  # the slowest axis of that level: a plan must not count on the best one
            chosen[level] = LinkSpec(max(link.latency_s for link in found), min(link.bandwidth_bytes_per_s for link in found))
            notes.append(f"{level}: fitted from all-reduces on {len(found)} mesh axis(es).")
    for level, other in (("intra_node", "inter_node"), ("inter_node", "intra_node")):
        if level not in chosen:
            if other in chosen:
                chosen[level] = chosen[other]
                notes.append(f"{level}: no axis measured it; copied from {other}.")
            else:
                chosen[level] = getattr(fallback, level)
                notes.append(f"{level}: not measured (no process group); taken from preset {base!r}.")
    notes.append(_axes_note(axes))
    return ClusterSpec(
        name=name or f"profiled-{device['device'].replace(' ', '-').lower()}",
        devices_per_node=devices_per_node,
        num_nodes=num_nodes,
        peak_flops=device["peak_flops"],
        memory_bandwidth_bytes_per_s=device["memory_bandwidth_bytes_per_s"],
        memory_bytes=device["memory_bytes"],
        intra_node=chosen["intra_node"],
        inter_node=chosen["inter_node"],
        source="autopar profile (measured)",
        notes=" ".join(notes),
        compute_slots_per_node=compute_slots_per_node,
        host_link=device.get("host_link"),
        rates=device.get("rates"),
    )


def _axes_note(axes: list[dict[str, Any]] | None) -> str:
    """The spec's note of what each mesh axis measured."""
    if not axes:
        return "Per axis: none measured."
    return "Per axis: " + "; ".join(
        f"axis {e['axis']} (size {e['size']}): "
        + (
            "not measured"
            if e["link"] is None
            else f"alpha {e['link'].latency_s:.3g} s, beta {e['link'].bandwidth_bytes_per_s:.3g} B/s"
        )
        for e in axes
    )


def profile_distributed(mesh_shape: Sequence[int], quick: bool = True) -> ClusterSpec:
    """Under an initialized process group: every rank measures its links, rank 0 its device.
    Returns the same spec on every rank."""
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    sizes = QUICK_ALLREDUCE_BYTES if quick else FULL_ALLREDUCE_BYTES
    axes = measure_axes(mesh_shape, sizes)
    payload: list[Any] = [measure_device(device_type, quick) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(payload, src=0)
    world = dist.get_world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    # CPU ranks share the host's cores: as many run at once as it has cores for their threads
    slots = cpu_cluster().compute_slots_per_node if device_type == "cpu" else None
    return build_spec(payload[0], axes, mesh_shape, per_node, max(world // per_node, 1), compute_slots_per_node=slots)


def _device_preset() -> str:
    """The preset whose links a spec of this device alone takes: its CUDA device's (by name,
    ``cost.cluster.local_cluster``), "h100-80g" for an unknown GPU, "cpu-gloo" without one."""
    if not torch.cuda.is_available():
        return CPU_PRESET
    try:
        return local_cluster().name.split(" (")[0]
    except ValueError:  # a GPU no preset names
        return "h100-80g"


def _spawned(rank: int, world_size: int, mesh_shape: tuple[int, ...], quick: bool) -> dict[str, Any]:
    return profile_distributed(mesh_shape, quick).to_json()


def profile_spawn(mesh_shape: Sequence[int], quick: bool = True, timeout_s: float = 300) -> ClusterSpec:
    """Spawn ``prod(mesh_shape)`` local gloo ranks (one thread each) and profile them."""
    results = run_distributed(_spawned, math.prod(mesh_shape), tuple(mesh_shape), quick, timeout_s=timeout_s)
    return ClusterSpec.from_json(results[0])


def run_profile(
    out: str, mesh_shape: Sequence[int] | None, spawn: bool, quick: bool, timeout_s: float = 300
) -> ClusterSpec | None:
    """What ``autopar profile`` does; returns the spec (None on ranks other than 0)."""
    if spawn:
        if mesh_shape is None:
            raise ConfigError("--spawn needs --mesh, e.g. --mesh 2x2, to know how many local ranks to start")
        spec = profile_spawn(mesh_shape, quick, timeout_s)
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        owned = not dist.is_initialized()
        if owned:
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        try:
            spec = profile_distributed(mesh_shape or (dist.get_world_size(),), quick)
            if dist.get_rank() != 0:
                return None
        finally:
            if owned:
                dist.destroy_process_group()
    else:
        if mesh_shape is not None and math.prod(mesh_shape) > 1:
            raise ConfigError(
                f"--mesh {'x'.join(map(str, mesh_shape))} needs ranks to time collectives on: add --spawn "
                "(local gloo ranks) or run under torchrun"
            )
        device = measure_device(None, quick)
        spec = build_spec(device, None, (1,), 1, 1, base=_device_preset())
    spec.save(out)
    return spec


__all__ = [
    "measure_device",
    "measure_matmul_flops",
    "measure_memory_bandwidth",
    "measure_axes",
    "fit_alpha_beta",
    "build_spec",
    "profile_distributed",
    "profile_spawn",
    "run_profile",
]
