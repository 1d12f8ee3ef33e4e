"""Module hooks meet the trace once: what a forward hook returns, or a forward pre-hook passes on,
is traced into the graph like the model's own code, but what a hook does besides (logging an
activation, appending to a list) runs only while tracing. A backward hook on a module
(``register_full_backward_hook``) would not run at all: the compiled module's gradients come
from the traced graph, not from the model's modules, so such a model is refused. A tensor hook
on a parameter registered before compile (``p.register_hook``) is traced and runs."""

from __future__ import annotations

import logging

import torch

from autopar.errors import TraceError

log = logging.getLogger("autopar")
_said: set[str] = set()  # the forward-hook notices given (a deep model is traced more than once)


def check_hooks(model: torch.nn.Module) -> None:
    """Refuse module backward hooks (the module's or global ones); say once which modules'
    forward hooks are traced, so that their side effects are not expected at every call."""
    hooks = torch.nn.modules.module
    backward = [name or "the model" for name, m in model.named_modules() if m._backward_hooks or m._backward_pre_hooks]
    if backward or hooks._global_backward_hooks or hooks._global_backward_pre_hooks:
        where = f"module {', '.join(repr(n) for n in backward[:3])}" if backward else "every module (a global hook)"
        raise TraceError(
            f"{where} has a backward hook (register_full_backward_hook or register_full_backward_pre_hook), which "
            "the compiled module would not run: its gradients come from the traced graph, not from the model's "
            "modules. Remove the hook before autopar.compile; to change a parameter's gradient, register a tensor "
            "hook on it (p.register_hook) before compile, which is traced"
        )
    forward = [name or "the model" for name, m in model.named_modules() if m._forward_hooks or _own(m._forward_pre_hooks)]
    if forward or hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
        where = ", ".join(repr(n) for n in forward[:3]) + (f" and {len(forward) - 3} more" if len(forward) > 3 else "")
        if where not in _said:
            _said.add(where)
            log.warning(
                "autopar: forward hooks on %s are traced into the graph: what they return is kept, but what they "
                "do besides (logging, collecting activations) runs only while tracing, not at each call",
                where or "every module (a global hook)",
            )


def _own(pre_hooks: dict) -> bool:
    """Whether a module's forward pre-hooks are the model's own: not autopar's guard of a model
    compiled before (``runtime.stale_model``), which computes nothing."""
    return any(not getattr(hook, "autopar_guard", False) for hook in pre_hooks.values())
