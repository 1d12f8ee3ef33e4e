"""How FSDP parameter gathers are grouped and when they are freed: the rule that the runtime
(``passes.schedule``, ``ops.buckets.ParamGathers``) carries out and the cost model
(``solver.problem.choices``, the liveness walk) prices, written once.

- A parameter's *layer* is its FQN up to the first numeric index ("transformer.h.3" for
  "transformer.h.3.attn.c_attn.weight"), "" for the root's parameters (embeddings, final norm,
  head), as FSDP2's ``fully_shard(block)`` then ``fully_shard(model)`` groups them.
- Gathers, in forward order of first use, form *groups* of consecutive parameters of one
  layer, process group and dtype, at most ``cap_bytes`` of whole parameters each (in the dtype
  they move: a precision policy's ``param_dtype``); a group is one all-gather of a flat buffer.
- A group is *resharded after forward* (its gathered parameters freed once forward no longer
  needs them, and all-gathered again in backward) as ``CommOptions.reshard_after_forward`` says:
  True every group, False none, None (FSDP2's default) every group but the root's, a tuple of
  layers every group but theirs.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from autopar.errors import ConfigError


def param_layer(fqn: str) -> str:
    """The layer a parameter belongs to: its FQN up to the first numeric index; "" for the root."""
    parts = fqn.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ""


def gather_groups(gathers: Sequence[tuple[str, str, Hashable, int]], cap_bytes: int) -> list[list[str]]:
    """Split ``gathers`` (key, layer, what must agree within a group (process group, dtype),
    bytes of the whole parameter), sorted by first use, into the runs gathered by one collective:
    consecutive keys of one layer and kind, at most ``cap_bytes`` of whole parameters each (a
    larger parameter alone; 0: one key each)."""
    runs: list[list[str]] = []
    previous, size = None, 0
    for key, layer, kind, nbytes in gathers:
        same = previous == (layer, kind)
        if runs and same and cap_bytes > 0 and size + nbytes <= cap_bytes:
            runs[-1].append(key)
            size += nbytes
        else:
            runs.append([key])
            size = nbytes
        previous = (layer, kind)
    return runs


def reshards(layer: str, reshard_after_forward: bool | None | str | tuple[str, ...]) -> bool:
    """Whether a gather group of ``layer`` is freed after forward and gathered again in backward
    (``CommOptions.reshard_after_forward``; None, and "auto" until the planner has chosen:
    every layer's but the root's, as FSDP2 keeps the root module's parameters, which backward
    needs first; a tuple: every layer's but those it names)."""
    if reshard_after_forward is None or reshard_after_forward == "auto":
        return layer != ""
    if isinstance(reshard_after_forward, tuple):
        return layer not in reshard_after_forward
    return bool(reshard_after_forward)


def check_kept_layers(reshard_after_forward, fqns) -> None:
    """ConfigError where ``CommOptions.reshard_after_forward`` is a tuple naming a layer that no
    parameter of ``fqns`` belongs to (a misspelt name would keep nothing, without a word)."""
    if not isinstance(reshard_after_forward, tuple):
        return
    layers = {param_layer(fqn) for fqn in fqns} | {""}  # the root's is one, if only of no parameter (nn.Sequential)
    unknown = [layer for layer in reshard_after_forward if layer not in layers]
    if unknown:
        named = sorted(layer for layer in layers if layer)
        shown = ", ".join(repr(layer) for layer in named[:3]) + (f", ... {named[-1]!r}" if len(named) > 3 else "")
        raise ConfigError(
            f"CommOptions(reshard_after_forward=...) names {', '.join(map(repr, unknown))}, which is no layer of the "
            f'model: name its layers as their parameters\' FQNs begin, up to the block index ({shown}; "" for the '
            'root\'s), or use "auto"'
        )


__all__ = ["param_layer", "gather_groups", "reshards", "check_kept_layers"]
