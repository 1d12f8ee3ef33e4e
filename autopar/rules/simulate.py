"""Check sharding strategies by simulating every rank of a mesh in one process.

For one op call on real tensors, ``check_op`` enumerates the op's strategies on a mesh, builds
each rank's local inputs from the global ones (chunks for Shard, random pieces that sum to the
tensor for Partial), runs the op on every rank's local inputs with size arguments localized,
reassembles the global output from the ranks' outputs, and compares it with the unsharded op.

Strategies that name a kernel need real collectives and are checked on gloo ranks instead
(``tests/runtime/test_module.py``); ``check_op`` reports them as skipped.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.ir.spec import Spec, is_strided, local_shape, strided_piece, unstride
from autopar.rules.registry import (
    Strategy,
    call_with_kw,
    localize_kwargs,
    node_strategies,
    op_info_from_values,
    replace_tensors,
)


@dataclass(frozen=True, slots=True)
class SimResult:
    strategy: Strategy
    ok: bool
    detail: str = ""


def _coords(mesh_shape: Sequence[int]) -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(n) for n in mesh_shape)))


def local_inputs(
    tensor: torch.Tensor, spec: Spec, mesh_shape: Sequence[int], generator: torch.Generator
) -> dict[tuple[int, ...], torch.Tensor]:
    """Each rank's local piece of ``tensor`` under ``spec`` (axis 0 outermost)."""
    pieces = {(): tensor}
    for axis, placement in enumerate(spec):
        size = mesh_shape[axis]
        nxt: dict[tuple[int, ...], torch.Tensor] = {}
        for coord, piece in pieces.items():
            if is_strided(placement):
                parts = [strided_piece(piece, placement.dim, size, i, placement.split_factor) for i in range(size)]
            elif isinstance(placement, Shard):
                parts = list(piece.chunk(size, placement.dim))
            elif isinstance(placement, Partial):
                if piece.dtype.is_floating_point:
                    noise = [torch.randn(piece.shape, generator=generator, dtype=piece.dtype) for _ in range(size - 1)]
                    parts = noise + [piece - sum(noise)] if noise else [piece]
                else:
                    parts = [piece] + [torch.zeros_like(piece) for _ in range(size - 1)]
            else:
                parts = [piece] * size
            for index, part in enumerate(parts):
                nxt[coord + (index,)] = part
        pieces = nxt
    return pieces


def assemble(outputs: dict[tuple[int, ...], torch.Tensor], spec: Spec, mesh_shape: Sequence[int], atol: float) -> torch.Tensor:
    """Rebuild the global tensor from every rank's output (innermost axis first)."""
    pieces = dict(outputs)
    for axis in reversed(range(len(spec))):
        placement = spec[axis]
        groups: dict[tuple[int, ...], list[torch.Tensor]] = {}
        for coord in sorted(pieces):
            groups.setdefault(coord[:axis], []).append(pieces[coord])
        merged: dict[tuple[int, ...], torch.Tensor] = {}
        for prefix, parts in groups.items():
            if is_strided(placement):
                merged[prefix] = unstride(torch.cat(parts, placement.dim), placement.dim, len(parts), placement.split_factor)
            elif isinstance(placement, Shard):
                merged[prefix] = torch.cat(parts, placement.dim)
            elif isinstance(placement, Partial):
                merged[prefix] = sum(parts[1:], parts[0])
            else:
                for part in parts[1:]:
                    if not torch.allclose(part.double(), parts[0].double(), atol=atol, rtol=1e-4):
                        raise AssertionError(f"replicated output differs between ranks on axis {axis}")
                merged[prefix] = parts[0]
        pieces = merged
    return pieces[()]


def check_strategy(
    target: Any,
    kw_values: dict[str, Any],
    strategy: Strategy,
    mesh_shape: Sequence[int],
    *,
    atol: float = 1e-5,
    seed: int = 20261122,
) -> SimResult:
    """Run ``strategy`` of one op on every simulated rank and compare with the unsharded op."""
    info = op_info_from_values("sim", target, kw_values, None)
    tensors = _tensors_in_order(kw_values)
    expected = call_with_kw(target, kw_values)
    generator = torch.Generator().manual_seed(seed)
    per_input = [local_inputs(t, spec, mesh_shape, generator) for t, spec in zip(tensors, strategy.ins)]
    expected_outs = list(expected) if isinstance(expected, (list, tuple)) else [expected]
    expected_outs = [e for e in expected_outs if isinstance(e, torch.Tensor)]
    outputs: list[dict[tuple[int, ...], torch.Tensor]] = [{} for _ in expected_outs]
    for coord in _coords(mesh_shape):
        local_kw = replace_tensors(info.kw, [pieces[coord] for pieces in per_input])
        out_local_shape = local_shape(expected_outs[0].shape, strategy.outs[0], mesh_shape)
        local_kw = localize_kwargs(target, local_kw, out_local_shape)
        result = call_with_kw(target, local_kw)
        result_list = list(result) if isinstance(result, (list, tuple)) else [result]
        result_list = [r for r in result_list if isinstance(r, torch.Tensor)]
        for index, tensor in enumerate(result_list):
            outputs[index][coord] = tensor
    for index, (exp, spec) in enumerate(zip(expected_outs, strategy.outs)):
        try:
            got = assemble(outputs[index], spec, mesh_shape, atol)
        except AssertionError as error:
            return SimResult(strategy, False, f"output {index}: {error}")
        if got.shape != exp.shape:
            return SimResult(strategy, False, f"output {index}: shape {tuple(got.shape)} != {tuple(exp.shape)}")
        if exp.dtype.is_floating_point:
            close = torch.allclose(got.double(), exp.double(), atol=atol, rtol=1e-4)
        else:
            close = torch.equal(got, exp)
        if not close:
            diff = (got.double() - exp.double()).abs().max().item()
            return SimResult(strategy, False, f"output {index}: max abs diff {diff:.3g}")
    return SimResult(strategy, True)


def check_op(
    target: Any,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    mesh_shape: Sequence[int] = (2,),
    *,
    atol: float = 1e-5,
) -> list[SimResult]:
    """Check every strategy of ``target(*args, **kwargs)`` on ``mesh_shape``.

    Returns one result per strategy; kernel strategies are returned with ``ok=True`` and
    ``detail="kernel: checked on gloo"``.
    """
    kw_values = _normalize(target, args, kwargs or {})
    expected = call_with_kw(target, kw_values)
    info = op_info_from_values("sim", target, kw_values, expected)
    results = []
    for strategy in node_strategies(info, mesh_shape):
        if strategy.kernel is not None:
            results.append(SimResult(strategy, True, "kernel: checked on gloo"))
            continue
        results.append(check_strategy(target, kw_values, strategy, mesh_shape, atol=atol))
    return results


def _normalize(target: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    for i, arg in enumerate(target._schema.arguments):
        if i < len(args):
            kw[arg.name] = args[i]
        elif arg.name in kwargs:
            kw[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            kw[arg.name] = arg.default_value
        else:
            kw[arg.name] = None
    return kw


def _tensors_in_order(kw_values: dict[str, Any]) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []

    def visit(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v)

    for value in kw_values.values():
        visit(value)
    return found


__all__ = ["SimResult", "check_op", "check_strategy", "local_inputs", "assemble", "Replicate"]
