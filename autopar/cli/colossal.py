"""``autopar plan MODEL --colossal-config config.py``: a Colossal-AI config as a plan, beside the solver's.

The config is a Python file defining ``parallel = dict(...)``, as Colossal-AI's are; it runs
with ``runpy``. The plan printed (and saved with ``--out``) is Colossal-AI's layout; under it,
the solver's own plan on the same mesh (and stages) is compared: by how much it is faster and
why (``autopar.report.versus``). ``autopar diff`` of the two saved plans lists every placement.
"""

from __future__ import annotations

import argparse
import math
import runpy
import time
from typing import Any

from autopar.errors import AutoparError


def read_parallel(path: str) -> dict[str, Any]:
    """The ``parallel`` dict of a Colossal-AI config file."""
    try:
        namespace = runpy.run_path(path)
    except FileNotFoundError:
        raise AutoparError(f"--colossal-config {path}: no such file") from None
    except Exception as error:  # noqa: BLE001 - the user's file: say which and why
        raise AutoparError(f"--colossal-config {path} failed to run: {type(error).__name__}: {error}") from error
    parallel = namespace.get("parallel")
    if not isinstance(parallel, dict):
        raise AutoparError(
            f"--colossal-config {path} defines no parallel = dict(...) (Colossal-AI's "
            "parallel config, e.g. parallel = dict(pipeline=2, tensor=dict(mode='2d', size=4)))"
        )
    return parallel


def plan_colossal(args: argparse.Namespace, model, inputs, cluster, progress) -> tuple[Any, list]:
    """(the Colossal-AI plan, the comparison blocks to print under its summary)."""
    from autopar import api
    from autopar.report.versus import versus_text
    from autopar.solver.planners.colossal import ColossalParallel

    parallel = read_parallel(args.colossal_config)
    world = math.prod(args.mesh) if args.mesh else args.devices
    config = ColossalParallel.from_dict(parallel, world)
    progress(config.describe())
    start = time.perf_counter()
    hand = api.hand_plan(
        "colossal",
        model,
        config.world_size,
        example_inputs=inputs,
        cluster=cluster,
        memory_budget=args.memory_budget,
        offload=args.offload,
        checkpointing=False if args.checkpointing is None else args.checkpointing,
        precision=args.precision,
        parallel=parallel,
        num_microbatches=args.num_microbatches,
    )
    progress(f"planned Colossal-AI's layout in {time.perf_counter() - start:.2f} s; now the solver's own plan ...")
    pipeline = config.pipeline if config.pipeline > 1 else "off"
    solved = api.plan(
        model,
        config.mesh_shape(),
        example_inputs=inputs,
        cluster=cluster,
        memory_budget=args.memory_budget,
        offload=args.offload,
        checkpointing=args.checkpointing,
        precision=args.precision,
        time_limit_s=args.time_limit,
        pipeline=pipeline,
        num_microbatches=args.num_microbatches if pipeline != "off" else None,
    )
    return hand, ["vs the solver's plan:\n" + versus_text(hand, solved, "Colossal-AI's layout")]
