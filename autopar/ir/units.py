"""Byte counts as people write them ("80GB", "70GiB"): parsed here once, for the API, the options
and the CLI alike. Imports nothing (the CLI parses its arguments before loading torch)."""

from __future__ import annotations

import math
import re

from autopar.errors import ConfigError

_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}


def parse_bytes(text: str) -> int:
    """``"70GiB"``, ``"512 MiB"``, ``"1.5GB"`` or ``"1000000"`` → bytes (ValueError otherwise)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _BYTE_UNITS:
        raise ConfigError(
            f"invalid memory budget {text!r}: expected bytes, or a number with a unit "
            "(KiB, MiB, GiB, TiB, KB, MB, GB), such as '70GiB'"
        )
    value = float(match.group(1)) * _BYTE_UNITS[unit]
    if not math.isfinite(value) or value < 1:
        raise ConfigError(f"invalid memory budget {text!r}: must be at least 1 byte")
    return int(value)


def parse_budget(value: float | str | None) -> float | None:
    """A memory budget as ``plan``, ``compile`` and the CLI take it: bytes, a string such as
    "80GB" or "70GiB", "none" or "inf" (no budget: ``float("inf")``), or None (the default)."""
    if isinstance(value, str):
        return float("inf") if value.strip().lower() in ("none", "inf") else float(parse_bytes(value))
    return value
