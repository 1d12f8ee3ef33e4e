"""Ask DTensor's sharding-propagation registry for ops that have no autopar rule."""

from __future__ import annotations

from autopar.rules.registry import OpInfo, Row


def rows_for(info: OpInfo) -> list[Row] | None:
    """Per-axis rows from DTensor's strategy for ``info.target``, or None if it has none."""
    return None
