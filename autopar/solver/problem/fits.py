"""Whether a peak fits a memory budget: one comparison for every solver path."""

from __future__ import annotations

# A peak this far over the budget, relatively, still fits: the same bytes summed in another
# order (the ILP's rows, the liveness walk) differ in the last bits.
RELATIVE_TOLERANCE = 1e-9


def fits(peak_bytes, budget: float | None):
    """``peak_bytes`` (a number, or a numpy array for each entry) within ``budget`` bytes per
    device; everything fits no budget (None)."""
    if budget is None:
        return True
    return peak_bytes <= budget * (1 + RELATIVE_TOLERANCE)
