"""Running a plan: ``compile``'s builder (``build``: trace, agree on a plan in ``agreement``, assemble)
and its checks (``compile_checks``); the compiled module (``module``, assembled by ``single``) and
its pipelined sibling (``pipeline``), both built on what they share (``base``: the shards, and the whole model's names, shapes and state),
sharded checkpoints (``checkpoint``), meta-device materialization (``materialize``), the offload
store and hooks (``store``, ``offload``), optimizers over offloaded state (``optim``). The tools
around the execution live in ``tools/``: process groups, spawning and comparison helpers
(``launch``), the full-world shape check (``check``), a step against eager (``numerics``) and the
machine profiler (``profile``); nothing here imports them."""

from autopar.runtime.module import ParallelModule

__all__ = ["ParallelModule"]
