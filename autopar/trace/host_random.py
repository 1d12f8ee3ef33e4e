"""Random numbers a forward draws from Python's ``random`` or NumPy while tracing.

A graph holds what its forward computed from host random numbers as constants: a layer skipped
with ``random.random() < p`` (LayerDrop written with Python's generator), a noise scale from
``np.random.rand()``. Eager draws again at every call; the compiled module would repeat the one
draw of the trace forever, without a word. Torch's own random ops (``torch.rand``, dropout) are
graph ops and draw at every call.

``export_checking_host_draws`` exports once and compares the two generators' states before and
after. Where the forward drew, it exports again from up to three other states: a graph that
differs depends on the draws, and ``TraceError`` names the fix (draw with torch); the same graph
every time (a draw that changes nothing, such as a LayerDrop of probability 0) passes with a
warning. Either way the generators are left as the first export left them.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from typing import Any

from autopar.errors import TraceError

log = logging.getLogger("autopar")
_OTHER_SEEDS = (0x5EED, 0x5EED + 1, 0x5EED + 2)  # the later exports' generators: other states than the first's


def _numpy_random():
    try:
        import numpy
    except ImportError:  # numpy is optional: nothing to compare
        return None
    return numpy.random


def _states() -> tuple[Any, Any]:
    numpy_random = _numpy_random()
    return random.getstate(), None if numpy_random is None else numpy_random.get_state()


def _same(a: tuple[Any, Any], b: tuple[Any, Any]) -> bool:
    if a[0] != b[0]:
        return False
    if a[1] is None or b[1] is None:
        return a[1] is b[1]
    return a[1][0] == b[1][0] and a[1][2:] == b[1][2:] and bool((a[1][1] == b[1][1]).all())


def _set_states(states: tuple[Any, Any]) -> None:
    random.setstate(states[0])
    numpy_random = _numpy_random()
    if numpy_random is not None and states[1] is not None:
        numpy_random.set_state(states[1])


def _export_from(seed: int, export: Callable[[], Any]) -> Any:
    random.seed(seed)
    numpy_random = _numpy_random()
    if numpy_random is not None:
        numpy_random.seed(seed)
    return export()


def export_checking_host_draws(export: Callable[[], Any], name: str) -> Any:
    """``export()`` (a ``torch.export`` of the model called ``name``), refused where the graph
    depends on Python or NumPy random numbers its forward drew (module docstring)."""
    before = _states()
    exported = export()
    after = _states()
    if _same(before, after):
        return exported
    try:
        depends = any(_export_from(seed, export).graph_module.code != exported.graph_module.code for seed in _OTHER_SEEDS)
    finally:
        _set_states(after)
    if depends:
        raise TraceError(
            f"{name}'s forward draws random numbers from Python's random or NumPy, and the traced graph depends on "
            "them: it would hold one draw for every call, where eager draws at each. Draw them with torch instead "
            "(torch.rand(()) < p, torch.randn(...)), which the graph draws at every call"
        )
    log.warning(
        "autopar: %s's forward drew random numbers from Python's random or NumPy while tracing; traces with "
        "other draws gave the same graph, so they seem to change nothing (the graph holds none). Draw with "
        "torch where they should change a call",
        name,
    )
    return exported


__all__ = ["export_checking_host_draws"]
