"""Where a 2-rank data-parallel step could wait for its peer: autopar's ddp plan with its forward's
wait moved or removed, against DDP, in the same gloo ranks (timing only: the moved variants'
losses are wrong).

    python benchmarks/probe_forward_wait.py --ranks 2 --steps 16 --warmup 3 --optimizer fused

``bench_vs_torch.py``'s trainers and loop (``--kinds`` as there), plus three variants of
``autopar_ddp`` that differ only in where the data check's all-gather, which carries the loss's
sum and denominator (``runtime.data._Check.ride``), is waited for:

- ``autopar_ddp+at_return``: posted at the loss as now, waited for (and checked) just before the
  call returns instead of at once: the latest point the tested contract allows (a mismatch raises
  from the call, and the call returns the whole batch's loss);
- ``autopar_ddp+in_backward``: waited for at the loss's backward, whose gradient (one over the
  whole batch's denominator) is the first thing that needs it: a lazy loss's best case (no check);
- ``autopar_ddp+never``: never waited for: no sync point in the forward at all (no check).

The variants return the rank's loss sum doubled instead of the whole batch's (a stand-in of the
same cost), so they time the step and nothing else. Ratios ``<variant>_over_ddp`` and
``..._cpu`` as ``bench_vs_torch.py`` reports its own; it writes ``results/forward_wait.csv``.
"""

from __future__ import annotations

import sys

import bench_vs_torch

_MODE: list[str | None] = [None]
_VARIANTS = ("at_return", "in_backward", "never")
_trainer = bench_vs_torch._trainer


def _patch() -> None:
    """Route ``_Check.ride``, ``_Check.__call__`` and the loss's backward by ``_MODE`` (once a process)."""
    from autopar.ops import parallel
    from autopar.runtime import data

    if getattr(data._Check, "_probed", False):
        return
    pending: list = []
    ride, settle, backward = data._Check.ride, data._Check.__call__, parallel._WholeMean.backward

    def probed_ride(check, x, group_name):
        if _MODE[0] is None:
            return ride(check, x, group_name)
        check.rode = True  # the module keeps deferring its check to the loss, as it does now
        if check._work is None:
            check.post()
        if _MODE[0] != "at_return":  # settled here: the call's end waits for nothing
            check._settled = True
            pending.append(check)
        return x * 2

    def probed_settle(check):
        if _MODE[0] in (None, "at_return"):
            settle(check)

    def probed_backward(ctx, grad):
        if _MODE[0] == "in_backward":
            for check in pending:
                check.wait()
        pending.clear()
        return backward(ctx, grad)

    data._Check.ride, data._Check.__call__ = probed_ride, probed_settle
    parallel._WholeMean.backward = staticmethod(probed_backward)
    data._Check._probed = True


def _probed_trainer(kind: str, world: int, rank: int, optimizer: str = "default", accum: int = 1):
    """``bench_vs_torch._trainer``; a ``<kind>+<variant>`` trainer runs its steps under that variant."""
    _patch()
    base, _, variant = kind.partition("+")
    step, module = _trainer(base, world, rank, optimizer, accum)
    if not variant:
        return step, module
    if variant not in _VARIANTS:
        raise SystemExit(f"unknown variant {variant!r}: one of {', '.join(_VARIANTS)}")

    def probed_step():
        _MODE[0] = variant
        try:
            return step()
        finally:
            _MODE[0] = None

    return probed_step, module


def _ratios(step_s: dict, suffix: str) -> dict:
    out = _plain_ratios(step_s, suffix)
    for kind, seconds in step_s.items():
        if "+" in kind and not suffix and "torch_ddp" in step_s:
            out[f"{kind.partition('+')[2]}_over_ddp"] = round(seconds / step_s["torch_ddp"], 3)
    return out


_plain_ratios = bench_vs_torch._ratios
# At import, not under __main__: the spawned ranks import this file, and their bench_vs_torch must
# build the probed trainers too.
bench_vs_torch._trainer, bench_vs_torch._ratios = _probed_trainer, _ratios

if __name__ == "__main__":
    if "--kinds" not in sys.argv:
        sys.argv += ["--kinds", "torch_ddp", "autopar_ddp", *(f"autopar_ddp+{variant}" for variant in _VARIANTS)]
    if "--out" not in sys.argv:
        sys.argv += ["--out", "benchmarks/results/forward_wait.csv"]
    bench_vs_torch.main()
