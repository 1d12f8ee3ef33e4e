"""Measured compute: time each distinct op and local shape on this device, cached on disk.

With ``ClusterSpec.compute == "measured"`` (``autopar.plan(..., compute="measured")``) the price
of an op under a strategy is the median time of its forward and backward on this machine's
device (CUDA when available, else CPU), run on random tensors of the *local* shapes that
strategy gives each rank. Ops it cannot run that way fall back to the roofline: views (free),
ops run as one of ``autopar.ops.kernels``, ops whose arguments spell global sizes (a reshape to a
global shape fails on a local tensor), and anything else that raises.

The cache is one JSON file per device and torch version under ``$AUTOPAR_CACHE`` (default
``~/.cache/autopar``), named ``compute-<device>-torch<version>.json``, mapping a key of op,
local shapes, dtypes, the other arguments and whether backward runs, to seconds (or ``null``:
not measurable, use the roofline). Delete the file to measure again.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from autopar.ir.spec import local_shape
from autopar.rules.registry import OpInfo, Strategy, TensorArg

_REPEATS = 5
_SAVE_EVERY = 50


def cache_dir() -> Path:
    return Path(os.environ.get("AUTOPAR_CACHE") or Path.home() / ".cache" / "autopar")


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_key(device: torch.device | None = None) -> str:
    device = device or _device()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu{torch.get_num_threads()}t"
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-").lower()


class MeasuredCache:
    """Seconds per op key for one device and torch version, loaded once and saved as it grows."""

    def __init__(self, path: Path):
        self.path = path
        self.entries: dict[str, float | None] = {}
        self.unsaved = 0
        if path.is_file():
            try:
                self.entries = json.loads(path.read_text())
            except json.JSONDecodeError:
                self.entries = {}  # a torn write: measure again
        atexit.register(self.save)

    def save(self) -> None:
        if not self.unsaved:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.entries, indent=0, sort_keys=True))
        tmp.replace(self.path)
        self.unsaved = 0

    def put(self, key: str, seconds: float | None) -> None:
        self.entries[key] = seconds
        self.unsaved += 1
        if self.unsaved >= _SAVE_EVERY:
            self.save()


_CACHES: dict[Path, MeasuredCache] = {}


def get_cache() -> MeasuredCache:
    path = cache_dir() / f"compute-{device_key()}-torch{torch.__version__.replace('+', '-')}.json"
    if path not in _CACHES:
        _CACHES[path] = MeasuredCache(path)
    return _CACHES[path]


def _local_value(value: Any, spec_of: dict[int, Sequence[int]], counter: list[int]) -> Any:
    """Replace each TensorArg (in order) by its local shape description."""
    if isinstance(value, TensorArg):
        index = counter[0]
        counter[0] += 1
        return ("tensor", tuple(spec_of[index]), value.dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_local_value(v, spec_of, counter) for v in value)
    return value


def op_key(info: OpInfo, strategy: Strategy, mesh_shape: Sequence[int], requires_grad: bool) -> tuple[str, dict]:
    """The cache key of one op under one strategy, and its keyword arguments with each tensor
    argument replaced by ``("tensor", local shape, dtype)``."""
    shapes = {i: local_shape(arg.shape, strategy.ins[i], mesh_shape) for i, arg in enumerate(info.inputs)}
    counter = [0]
    kw = {name: _local_value(value, shapes, counter) for name, value in info.kw.items()}
    return f"{info.target}|{kw!r}|grad={requires_grad}", kw


def _materialize(value: Any, device: torch.device, leaves: list[torch.Tensor]) -> Any:
    if isinstance(value, tuple) and len(value) == 3 and value[0] == "tensor":
        _, shape, dtype = value
        if dtype.is_floating_point:
            tensor = torch.randn(shape, device=device, dtype=dtype).requires_grad_(True)
            leaves.append(tensor)
        elif dtype == torch.bool:
            tensor = torch.ones(shape, device=device, dtype=dtype)
        else:
            tensor = torch.zeros(shape, device=device, dtype=dtype)  # indices: 0 is always valid
        return tensor
    if isinstance(value, (list, tuple)):
        return type(value)(_materialize(v, device, leaves) for v in value)
    return value


def _step(target: Any, kw: dict, device: torch.device, requires_grad: bool):
    """A closure that runs the op once, forward and (when ``requires_grad``) backward, on fresh
    random inputs made once."""
    leaves: list[torch.Tensor] = []
    kwargs = {name: _materialize(value, device, leaves) for name, value in kw.items()}
    schema = target._schema.arguments
    args = [kwargs.pop(a.name) for a in schema if not a.kwarg_only and a.name in kwargs]

    def run() -> None:
        out = target(*args, **kwargs)
        if requires_grad and leaves:
            outs = [
                o for o in (out if isinstance(out, (list, tuple)) else [out]) if isinstance(o, torch.Tensor) and o.requires_grad
            ]
            if outs:
                torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs], allow_unused=True)

    return run


def _seconds_per_call(run, device: torch.device) -> float:
    """On CUDA: ``_REPEATS`` calls back to back between two events, per call. Ops in a training
    step are queued asynchronously, so a step costs the GPU's time per op, not the host's
    launch-and-wait latency that timing one synchronized call would add to every small op.
    On CPU (synchronous): the median of ``_REPEATS`` timed calls."""
    run()  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(_REPEATS):
            run()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3 / _REPEATS
    times = []
    for _ in range(_REPEATS):
        begin = time.perf_counter()
        run()
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


def measured_seconds(info: OpInfo, strategy: Strategy, mesh_shape: Sequence[int], requires_grad: bool) -> float | None:
    """Forward (+ backward when ``requires_grad``) seconds of the local op on this device, from
    the cache or measured now; None where it cannot be measured (use the roofline)."""
    if strategy.kernel is not None or not isinstance(info.target, torch._ops.OpOverload):
        return None
    key, kw = op_key(info, strategy, mesh_shape, requires_grad)
    cache = get_cache()
    if key in cache.entries:
        return cache.entries[key]
    device = _device()
    try:
        seconds: float | None = _seconds_per_call(_step(info.target, kw, device, requires_grad), device)
    except Exception:  # noqa: BLE001 - any op that cannot run on local shapes uses the roofline
        seconds = None
    cache.put(key, seconds)
    return seconds


__all__ = ["measured_seconds", "op_key", "cache_dir", "device_key", "get_cache", "MeasuredCache"]
