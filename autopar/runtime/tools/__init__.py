"""The tools around running a plan, apart from the execution itself: checking (``check``, the
full-world shape check of ``autopar check``; ``numerics``, a compiled step against eager),
profiling (``profile``, ``profile_rates``: ``autopar profile`` measures a machine into a cluster
spec) and launching (``launch``: process groups, spawned ranks and comparison helpers for scripts
and tests). The execution (``autopar.runtime``) never imports them (an import-linter contract)."""
