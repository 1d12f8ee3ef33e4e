"""The ``autopar`` command line.

    autopar plan MODEL_SPEC (--mesh 2x4 | --devices 64) [--cluster h100-80g|FILE]
                 [--memory-budget 70GiB] [--offload auto] [--checkpointing selective]
                 [--batch-size N] [--seq-len N] [--num-layers N] [--meta]
                 [--out plan.json] [--json]
    autopar show plan.json [--all] [--json] [--html report.html]
    autopar explain plan.json [NODE_OR_PARAM] [--json]
    autopar diff a.json b.json [--json]
    autopar check plan.json [--model MODEL_SPEC] [--rank R] [--numerics] [--json]
    (every command also takes --verbose: the solver's log on stderr, and --debug: tracebacks)

MODEL_SPEC is a built-in model name (``autopar.zoo.models.MODEL_NAMES``), a published shape
(``autopar.zoo.shapes.PRESETS``: gpt2, gpt2-xl, llama-2-7b, llama-2-70b, llama-3-8b, built on
the meta device), or ``module:callable`` (``path/to/file.py:callable`` works too), where the
callable returns ``(model, example_inputs)``. ``plan`` records the MODEL_SPEC in the plan, so
that ``check`` can rebuild the model.

Every user mistake prints ``autopar: error: <reason>`` to stderr (a multi-line reason, such as an
InfeasibleError's largest tensors and fix, continues on indented lines) and exits with status 2
(bad arguments) or 1 (errors while running); ``--debug`` shows the traceback instead.
"""

# Every autopar import in this file sits inside the command that needs it, for start-up speed:
# `autopar --help` and argument errors load no torch.
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import json
import math
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autopar.errors import CliError  # torch-free: the CLI starts without loading torch

if TYPE_CHECKING:
    from autopar.cli.console import Progress

PROG = "autopar"


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, ``autopar: error: <reason>``, status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        _print_error(message)
        raise SystemExit(2)


def error_text(message: str) -> str:
    """``autopar: error: <first line>``, then the message's other lines, indented under it: an
    error's line breaks (the largest tensors, the fix) are kept."""
    lines = [line.rstrip() for line in str(message).strip().splitlines() if line.strip()]
    first, rest = (lines[0], lines[1:]) if lines else ("unknown error", [])
    return "\n".join([f"{PROG}: error: {first}"] + [line if line.startswith("  ") else f"  {line}" for line in rest])


def _print_error(message: str) -> None:
    from autopar.cli.console import print_error

    print_error(error_text(message))


# -- argument types ---------------------------------------------------------------------------


def parse_mesh(text: str) -> tuple[int, ...]:
    """``"2x4"``, ``"2,4"`` or ``"8"`` → a tuple of positive ints."""
    parts = re.split(r"[x,]", text.strip().lower())
    if not text.strip() or any(not p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"invalid mesh {text!r}: expected positive sizes such as '2x4', '2,4' or '8'")
    shape = tuple(int(p) for p in parts)
    if any(n < 1 for n in shape):
        raise argparse.ArgumentTypeError(f"invalid mesh {text!r}: every mesh size must be at least 1")
    return shape


def parse_budget(text: str) -> float:
    """``parse_bytes``, or ``"none"`` / ``"inf"`` for no budget (``autopar.ir.units.parse_budget``)."""
    from autopar.ir.units import parse_budget as parse

    try:
        return parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def parse_bytes(text: str) -> int:
    """``"70GiB"``, ``"512 MiB"``, ``"1.5GB"`` or ``"1000000"`` → bytes (``autopar.ir.units.parse_bytes``)."""
    from autopar.ir.units import parse_bytes as parse

    try:
        return parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _cluster(text: str):
    from autopar.cost.cluster import get_cluster

    try:
        return get_cluster(text)
    except (ValueError, OSError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None


# --checkpointing's words and the ``checkpointing=`` value each stands for.
CHECKPOINTING = {"auto": None, "off": False, "selective": "selective", "selective-op": "selective-op", "full": "full"}


def _checkpointing(text: str) -> bool | str | None:
    if text not in CHECKPOINTING:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(CHECKPOINTING)}, got {text!r}")
    return CHECKPOINTING[text]


def _stages(text: str) -> int | str:
    return "auto" if text == "auto" else _positive_int(text)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction from 0 to 1 (such as 0.05), got {text!r}")
    return value


# -- model loading ----------------------------------------------------------------------------


def _progress(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def _shape_overrides(spec: str, seq_len: int | None, num_layers: int | None) -> tuple[dict, dict]:
    """(model config, batch config) for --seq-len and --num-layers of a built-in gpt or llama."""
    if (seq_len or num_layers) and spec not in ("gpt", "llama"):
        raise CliError(f"--seq-len and --num-layers apply to gpt, llama and the presets, not to {spec!r}")
    return ({"n_layer": num_layers} if num_layers else {}), ({"seq_len": seq_len} if seq_len else {})


def load_model(
    spec: str, batch_size: int, meta: bool, seq_len: int | None = None, num_layers: int | None = None
) -> tuple[Any, tuple]:
    """``(model, example_inputs)`` for a built-in name, a preset, or a ``module:callable`` MODEL_SPEC."""
    import torch

    from autopar.zoo import models
    from autopar.zoo import shapes as model_specs

    if spec in model_specs.PRESETS:
        return model_specs.build_preset(spec, batch_size, seq_len, num_layers)
    if spec in models.MODEL_NAMES:
        config, batch_config = _shape_overrides(spec, seq_len, num_layers)
        if meta:
            with torch.device("meta"):
                model = models.build_model(spec, **config)
                inputs = models.example_batch(spec, batch_size, **config, **batch_config)
            inputs = tuple(
                t if not isinstance(t, torch.Tensor) or t.is_meta else torch.empty_like(t, device="meta") for t in inputs
            )
        else:
            model = models.build_model(spec, **config)
            inputs = models.example_batch(spec, batch_size, **config, **batch_config)
        return model, tuple(inputs)
    if ":" not in spec:
        raise CliError(
            f"unknown model {spec!r}: expected a built-in name ({', '.join(models.MODEL_NAMES)}), a preset "
            f"({', '.join(model_specs.PRESETS)}) or module:callable returning (model, example_inputs)"
        )
    if seq_len or num_layers:
        raise CliError("--seq-len and --num-layers apply to gpt, llama and the presets, not to module:callable")
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise CliError(f"invalid MODEL_SPEC {spec!r}: expected module:callable")
    module = _import(module_name, spec)
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise CliError(f"MODEL_SPEC {spec!r}: module {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise CliError(f"MODEL_SPEC {spec!r}: {attr!r} is not callable")
    try:
        result = target()
    except Exception as error:  # the user's code: report it in one line
        raise CliError(f"MODEL_SPEC {spec!r} raised {type(error).__name__}: {error}") from error
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.nn.Module)):
        raise CliError(
            f"MODEL_SPEC {spec!r} must return (model, example_inputs) with an nn.Module and a tuple, got {type(result).__name__}"
        )
    model, inputs = result
    if isinstance(inputs, list):
        inputs = tuple(inputs)
    if not isinstance(inputs, tuple):
        inputs = (inputs,)
    return model, inputs


def _import(module_name: str, spec: str):
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise CliError(f"MODEL_SPEC {spec!r}: file {module_name!r} does not exist")
        mod_spec = importlib.util.spec_from_file_location(path.stem, path)
        if mod_spec is None or mod_spec.loader is None:
            raise CliError(f"MODEL_SPEC {spec!r}: cannot load {module_name!r}")
        module = importlib.util.module_from_spec(mod_spec)
        try:
            mod_spec.loader.exec_module(module)
        except Exception as error:
            raise CliError(f"MODEL_SPEC {spec!r}: importing {module_name!r} raised {type(error).__name__}: {error}") from error
        return module
    # Like ``python -m``: modules in the working directory are importable.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(module_name)
    except ImportError as error:
        raise ImportError(f"cannot import module {module_name!r} of MODEL_SPEC {spec!r}: {error}") from error
    except Exception as error:
        raise CliError(f"MODEL_SPEC {spec!r}: importing {module_name!r} raised {type(error).__name__}: {error}") from error


# -- commands ---------------------------------------------------------------------------------


def _model_record(args: argparse.Namespace) -> dict[str, Any]:
    """How ``check`` rebuilds the model: the MODEL_SPEC and the settings that shape it."""
    from autopar.zoo.shapes import PRESETS

    meta = bool(args.meta) or args.model in PRESETS  # presets are always built on the meta device
    record: dict[str, Any] = {"spec": args.model, "batch_size": args.batch_size, "meta": meta}
    if args.seq_len:
        record["seq_len"] = args.seq_len
    if args.num_layers:
        record["num_layers"] = args.num_layers
    return record


class _ProgressLog:
    """Sends the planner's stage messages (INFO on the ``autopar`` logger) to ``progress``."""

    def __init__(self, progress: Progress) -> None:
        import logging

        class Forward(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                progress.line(record.getMessage())

        self.logger = logging.getLogger("autopar")
        self.handler = Forward()
        self.handler.addFilter(lambda record: record.levelno == logging.INFO)
        self.level = self.logger.level

    def __enter__(self) -> _ProgressLog:
        import logging

        self.logger.addHandler(self.handler)
        self.logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)


def cmd_plan(args: argparse.Namespace) -> int:
    from autopar import api
    from autopar.cli.console import Progress, emit
    from autopar.cli.views import mesh_search_table, plan_blocks
    from autopar.cost.cluster import get_cluster
    from autopar.ir.data import DataOptions
    from autopar.ir.options import PlanOptions

    cluster = args.cluster if args.cluster is not None else get_cluster(None)
    if args.out:
        _check_writable(args.out)
    if args.colossal_config is None and not (args.mesh or args.devices):
        raise CliError("plan needs --mesh or --devices (or --colossal-config, whose config lays out the mesh)")
    if args.colossal_config is not None and args.pipeline is not None:
        raise CliError("--pipeline with --colossal-config: the config's parallel['pipeline'] sets the stages")
    pipelined = args.pipeline is not None or args.num_microbatches is not None
    if args.colossal_config is None and pipelined and (args.pipeline is None or not args.mesh):
        raise CliError(
            "--num-microbatches and --pipeline need --pipeline N and --mesh: a pipeline cuts axis 0 of a given mesh into N stages"
        )
    options = PlanOptions.from_keywords(
        memory_budget=args.memory_budget,
        time_limit_s=args.time_limit,
        pipeline=args.pipeline or "off",
        num_microbatches=args.num_microbatches,
        offload=args.offload,
        checkpointing=args.checkpointing,
        devices=None if args.mesh else args.devices,
        precision=args.precision,
        data=DataOptions(batch=args.data),
        optimizer=args.optimizer,
    )
    if args.budget_gap is not None:
        options = options.replace(solve=dataclasses.replace(options.solve, budget_gap=args.budget_gap))
    start = time.perf_counter()
    with Progress(PROG) as progress:
        progress(f"building {args.model}{' on the meta device' if args.meta else ''} ...")
        model, inputs = load_model(args.model, args.batch_size, args.meta, args.seq_len, args.num_layers)
        progress(f"built {type(model).__name__} in {time.perf_counter() - start:.2f} s")
        stage = time.perf_counter()
        comparison: list = []
        if args.colossal_config is not None:
            from autopar.cli.colossal import plan_colossal

            with _ProgressLog(progress):
                plan, comparison = plan_colossal(args, model, inputs, cluster, progress)
        else:
            if not args.mesh:
                progress(f"planning on every mesh of {args.devices} devices for cluster {getattr(cluster, 'name', '?')} ...")
            with _ProgressLog(progress):
                plan = api.plan_model(model, args.mesh or "auto", inputs, None, cluster, options, on_progress=progress)
        plan = plan.with_model(_model_record(args))
        progress(
            f"planned {len(plan.nodes)} nodes in {time.perf_counter() - stage:.2f} s (total {time.perf_counter() - start:.2f} s)"
        )
        if args.out:
            plan.save(args.out)
            progress(f"saved the plan to {args.out}")
    if args.json:
        print(plan.to_json())
        return 0
    blocks = [mesh_search_table(plan.stats["mesh_search"])] if "mesh_search" in plan.stats else []
    emit(blocks + plan_blocks(plan) + comparison)
    return 0


def _check_writable(path: str) -> None:
    """Refuse an ``--out`` that cannot be written before planning, not after (the plan would be lost)."""
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        raise CliError(f"--out {path} is a directory: pass a file name, such as {target / 'plan.json'}")
    if not folder.is_dir():
        raise CliError(f"--out {path}: the directory {folder} does not exist; create it or pass another path")
    if not os.access(target if target.exists() else folder, os.W_OK):
        raise CliError(
            f"--out {path} is not writable (permission denied on {target if target.exists() else folder}): "
            "pass a path you can write"
        )


def _device_memory(cluster_name: str) -> int | None:
    """The device memory of the cluster a plan was priced for, where it is a preset or a readable file."""
    from autopar.cost.cluster import get_cluster

    try:
        return get_cluster(cluster_name).memory_bytes if cluster_name else None
    except (ValueError, OSError):
        return None


def cmd_show(args: argparse.Namespace) -> int:
    from autopar.cli.console import emit
    from autopar.cli.views import plan_blocks, show_json
    from autopar.ir.plan import Plan

    plan = Plan.load(args.plan)
    if args.html:
        from autopar.report.html import write_html

        write_html(
            plan, args.html, title=f"autopar plan {Path(args.plan).name}", device_memory_bytes=_device_memory(plan.cluster)
        )
        _progress(f"wrote {args.html}")
    if args.json:
        print(json.dumps(show_json(plan), separators=(",", ":")))
    elif not args.html or args.all:
        emit(plan_blocks(plan, everything=args.all))
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from autopar.ir.plan import Plan
    from autopar.report.explain import explain_json, explain_text

    plan = Plan.load(args.plan)
    if plan.pipeline is not None and args.node in (None, "pipeline"):
        from autopar.report.pipeline_explain import explain_pipeline_json, explain_pipeline_text

        print(json.dumps(explain_pipeline_json(plan), separators=(",", ":")) if args.json else explain_pipeline_text(plan))
        return 0
    if args.node is None:
        raise CliError(f"{args.plan} is not pipelined: name a node or a parameter FQN to explain")
    if not plan.decisions and plan.pipeline is not None:
        raise CliError(
            f"{args.plan} is a pipelined plan, whose stages take their choices from several "
            "candidate plans, and it records no explanations of single nodes yet: `autopar explain "
            f"{args.plan}` explains its schedule, stages and microbatches; plan the same model on the "
            "stage mesh without --pipeline to explain the intra-stage choices"
        )
    if not plan.decisions:
        raise CliError(
            f"{args.plan} holds no decisions to explain (it was written by an autopar "
            "without them, or by hand): re-plan it with this autopar"
        )
    if args.json:
        print(json.dumps(explain_json(plan, args.node), separators=(",", ":")))
    else:
        print(explain_text(plan, args.node))
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from autopar.ir.plan import Plan
    from autopar.runtime.tools.check import check_plan

    plan = Plan.load(args.plan)
    record = dict(plan.model)
    if args.model:
        record = {
            "spec": args.model,
            "batch_size": args.batch_size or 8,
            "meta": args.meta,
            "seq_len": args.seq_len,
            "num_layers": args.num_layers,
        }
    if not record.get("spec"):
        raise CliError(
            f"{args.plan} does not say which model it plans (it was not made by `autopar plan`): pass --model MODEL_SPEC"
        )
    start = time.perf_counter()
    _progress(f"building {record['spec']} ...")
    model, inputs = load_model(
        record["spec"], record.get("batch_size") or 8, bool(record.get("meta")), record.get("seq_len"), record.get("num_layers")
    )
    world = math.prod(plan.mesh_shape)
    if args.numerics:
        return _check_numerics(args, plan, model, inputs, world, start)
    _progress(f"checking rank {args.rank} of {world} on a fake process group ...")
    result = check_plan(plan, model, inputs, rank=args.rank)
    _progress(f"checked in {time.perf_counter() - start:.2f} s")
    if args.json:
        print(
            json.dumps(
                {
                    "ok": result.ok,
                    "rank": result.rank,
                    "world_size": result.world_size,
                    "coordinate": list(result.coordinate),
                    "num_nodes": result.num_nodes,
                    "num_inputs": result.num_inputs,
                    "num_collectives": result.num_collectives,
                    "mismatches": list(result.mismatches),
                },
                separators=(",", ":"),
            )
        )
    else:
        print(result.text())
    return 0 if result.ok else 1


def _check_numerics(args: argparse.Namespace, plan, model, inputs, world: int, start: float) -> int:
    from autopar.runtime.tools.numerics import check_numerics
    from autopar.trace.fake import has_meta_tensors

    if has_meta_tensors(model):
        raise CliError(
            f"--numerics runs the model on real tensors, but {plan.model.get('spec')} is built on the "
            "meta device (a published shape): check a small built-in model, or pass --model without --meta"
        )
    _progress(f"running all {world} ranks in this process and eager, on the plan's inputs ...")
    result = check_numerics(model, plan, inputs if isinstance(inputs, tuple) else (inputs,))
    _progress(f"checked in {time.perf_counter() - start:.2f} s")
    if args.json:
        first = result.first_bad
        print(
            json.dumps(
                {
                    "ok": result.ok,
                    "mesh": list(result.mesh_shape),
                    "num_nodes": result.num_nodes,
                    "loss": list(result.loss) if result.loss else None,
                    "max_grad_rel": result.max_grad_rel,
                    "first_bad": None if first is None else {"node": first.node, "op": first.op, "rel_diff": first.rel_diff},
                },
                separators=(",", ":"),
            )
        )
    else:
        print(result.text())
    return 0 if result.ok else 1


def cmd_diff(args: argparse.Namespace) -> int:
    from autopar.cli.console import emit
    from autopar.cli.views import diff_blocks, plan_diff
    from autopar.ir.plan import Plan

    a, b = Plan.load(args.a), Plan.load(args.b)
    diff = plan_diff(a, b)
    if args.json:
        print(json.dumps({"identical": not diff, **diff}, separators=(",", ":")))
    else:
        from autopar.report.versus import versus_text

        faster = []
        if diff and a.predicted.step_time_s and b.predicted.step_time_s:
            # By how much and why the faster plan is faster: the slower one first.
            slow, fast = ((a, "a"), (b, "b")) if a.predicted.step_time_s >= b.predicted.step_time_s else ((b, "b"), (a, "a"))
            faster = [versus_text(slow[0], fast[0], slow[1], fast[1])]
        emit(diff_blocks(diff, args.a, args.b, a, b) + faster)
    return 0


# -- entry point ------------------------------------------------------------------------------


def _add_common(parser: argparse.ArgumentParser, default: Any) -> None:
    parser.add_argument("--debug", action="store_true", default=default, help="show tracebacks instead of error messages")
    parser.add_argument(
        "--verbose", action="store_true", default=default, help="print the solver's log to stderr (as does setting AUTOPAR_LOG=1)"
    )


def _add_plan_command(sub: Any, common: argparse.ArgumentParser) -> None:
    """``autopar plan``: its arguments."""
    from autopar.cli.catalog import DEFAULT_CLUSTER, MODEL_NAMES, MODEL_PRESETS, cluster_presets

    p = sub.add_parser("plan", parents=[common], help="plan a model on a mesh and print the plan summary")
    p.add_argument(
        "model",
        metavar="MODEL_SPEC",
        help=f"a built-in model ({', '.join(MODEL_NAMES)}), a preset ({', '.join(MODEL_PRESETS)}) "
        "or module:callable returning (model, example_inputs)",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--mesh", type=parse_mesh, help="mesh sizes: 2x4, 2,4 or 8")
    where.add_argument(
        "--devices", type=_positive_int, help="search every mesh of this many devices (1 to 3 axes) and keep the fastest"
    )
    p.add_argument(
        "--cluster",
        type=_cluster,
        default=None,
        help=f"a preset ({', '.join(cluster_presets())}; default {DEFAULT_CLUSTER}) or a JSON/TOML file",
    )
    p.add_argument(
        "--memory-budget",
        type=parse_budget,
        default=None,
        help="bytes per device, e.g. 70GiB, 512MiB, 16GB, or 'none' (default: the cluster's device memory less a 10%% reserve)",
    )
    p.add_argument(
        "--precision",
        default="32-true",
        choices=("32-true", "bf16-mixed", "bf16-true"),
        help="the precision policy the plan is priced for (default 32-true: the model's own dtypes)",
    )
    p.add_argument(
        "--optimizer",
        default="adamw",
        help="the optimizer the training loop steps with, priced: adamw, adam, adamw-amsgrad, adam-amsgrad, sgd, sgd-momentum, and after a colon "
        "how it runs, e.g. adamw:fused (default adamw: torch's AdamW as it runs by default on the devices)",
    )
    p.add_argument(
        "--data",
        default="whole",
        choices=("whole", "per_rank"),
        help="how the compiled module takes its data: the same whole batch on every rank (default), "
        "or each data-parallel rank its own rows (the plan records its data-parallel size)",
    )
    p.add_argument("--batch-size", type=_positive_int, default=8, help="batch size of built-in models (default 8)")
    p.add_argument("--seq-len", type=_positive_int, default=None, help="sequence length of gpt, llama and presets")
    p.add_argument(
        "--num-layers",
        type=_positive_int,
        default=None,
        help="depth of gpt, llama and presets (a 2-layer llama-2-70b has the real widths)",
    )
    p.add_argument("--meta", action="store_true", help="build built-in models and inputs on the meta device")
    _add_plan_options(p)


def _add_plan_options(p: argparse.ArgumentParser) -> None:
    """``autopar plan``'s options beyond the model, the mesh and the cluster."""
    p.add_argument("--time-limit", type=_positive_float, default=60.0, help="solver time limit in seconds")
    p.add_argument(
        "--budget-gap",
        type=_fraction,
        default=None,
        help="under a binding memory budget, keep the fast search's plan within this fraction of the bound, "
        "and try checkpointing and offload only on shardings that could win back more "
        "(default 0.05; 0: always try the MILP too, and every sharding; 1: neither, the same plan on every machine)",
    )
    p.add_argument(
        "--pipeline",
        type=_stages,
        default=None,
        metavar="N|auto",
        help="cut mesh axis 0 into N pipeline stages, or let the planner choose (auto); needs --mesh",
    )
    p.add_argument(
        "--num-microbatches",
        type=_positive_int,
        default=None,
        metavar="M",
        help="with --pipeline: microbatches per step (default N, or 1 with auto)",
    )
    p.add_argument(
        "--offload",
        default="off",
        metavar="auto|off|cpu|disk",
        help="when no sharding fits --memory-budget, let the planner add checkpointing and offload "
        "(autopar.plan's offload=; with --mesh only)",
    )
    p.add_argument(
        "--checkpointing",
        type=_checkpointing,
        default=None,
        metavar="auto|off|selective|selective-op|full",
        help="activation checkpointing: auto (the default: each layer selective, selective-op or full where the budget binds), "
        "off, or a policy every layer takes (docs/memory.md; autopar.plan's checkpointing=)",
    )
    p.add_argument(
        "--colossal-config",
        metavar="CONFIG.py",
        help="plan Colossal-AI's layout from a config file defining parallel = dict(...) (1d, 2d, 2.5d, "
        "3d tensor parallelism and pipeline stages; --mesh/--devices: the world size, the rest is "
        "data parallel) and compare it with the solver's own plan",
    )
    p.add_argument("--out", help="save the plan JSON here")
    p.add_argument("--json", action="store_true", help="print the plan JSON instead of the summary")
    p.set_defaults(func=cmd_plan)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="autopar: an auto-parallel compiler for PyTorch training.")
    _add_common(parser, False)
    common = argparse.ArgumentParser(add_help=False)
    _add_common(common, argparse.SUPPRESS)  # after the command too; SUPPRESS keeps the global value
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    _add_plan_command(sub, common)

    s = sub.add_parser("show", parents=[common], help="print a saved plan's summary")
    s.add_argument("plan", help="plan JSON file")
    s.add_argument("--json", action="store_true", help="print a compact JSON summary")
    s.add_argument("--html", metavar="PATH", help="write a self-contained HTML report here")
    s.add_argument("--all", action="store_true", help="list every parameter and operator after the grouped view")
    s.set_defaults(func=cmd_show)

    e = sub.add_parser(
        "explain", parents=[common], help="why the plan chose a node's or a parameter's sharding, or a pipelined plan's schedule"
    )
    e.add_argument("plan", help="plan JSON file")
    e.add_argument(
        "node",
        metavar="NODE_OR_PARAM",
        nargs="?",
        help="a node name or a parameter FQN; for a pipelined plan, leave out (or 'pipeline') to explain "
        "its schedule, stages, microbatches and bubble",
    )
    e.add_argument("--json", action="store_true", help="print the decision as JSON")
    e.set_defaults(func=cmd_explain)

    c = sub.add_parser(
        "check", parents=[common], help="run the plan's rewritten forward at full world size on a fake process group"
    )
    c.add_argument("plan", help="plan JSON file")
    c.add_argument("--model", metavar="MODEL_SPEC", help="the model (default: the MODEL_SPEC recorded in the plan)")
    c.add_argument("--batch-size", type=_positive_int, default=None, help="with --model: batch size (default 8)")
    c.add_argument("--seq-len", type=_positive_int, default=None, help="with --model: sequence length")
    c.add_argument("--num-layers", type=_positive_int, default=None, help="with --model: depth")
    c.add_argument("--meta", action="store_true", help="with --model: build a built-in model on the meta device")
    c.add_argument("--rank", type=_nonnegative_int, default=0, help="the rank whose module runs (default 0)")
    c.add_argument(
        "--numerics",
        action="store_true",
        help="run every rank's rewritten module in this process on the model's real tensors and "
        "compare each node, the loss and every gradient with eager (names the first node that differs)",
    )
    c.add_argument("--json", action="store_true", help="print the result as JSON")
    c.set_defaults(func=cmd_check)

    d = sub.add_parser("diff", parents=[common], help="what changed between two plans")
    d.add_argument("a", help="first plan JSON file")
    d.add_argument("b", help="second plan JSON file")
    d.add_argument("--json", action="store_true", help="print the differences as JSON")
    d.set_defaults(func=cmd_diff)

    f = sub.add_parser(
        "profile", parents=[common], help="measure this machine (roofline, links per mesh axis) into a ClusterSpec file"
    )
    f.add_argument("--out", required=True, help="write the ClusterSpec JSON (or .toml) here")
    f.add_argument("--mesh", type=parse_mesh, default=None, help="mesh whose axes' links to time, e.g. 2x2")
    f.add_argument("--spawn", action="store_true", help="start prod(mesh) local gloo ranks to time collectives")
    f.add_argument("--full", action="store_true", help="larger matmuls, copies and all-reduces (slower, steadier)")
    f.set_defaults(func=cmd_profile)
    return parser


def cmd_profile(args: argparse.Namespace) -> int:
    from autopar.runtime.tools.profile import run_profile

    spec = run_profile(args.out, args.mesh, args.spawn, quick=not args.full)
    if spec is not None:
        print(
            f"wrote {args.out}: {spec.name}, float32 {spec.peak_flops['float32']:.3g} FLOP/s, "
            f"memory {spec.memory_bandwidth_bytes_per_s:.3g} B/s, intra-node alpha {spec.intra_node.latency_s:.3g} s "
            f"beta {spec.intra_node.bandwidth_bytes_per_s:.3g} B/s"
        )
        if spec.host_link is not None:
            print(f"  host link {spec.host_link.bandwidth_bytes_per_s:.3g} B/s, alpha {spec.host_link.latency_s:.3g} s")
        if spec.rates is not None:
            rates = spec.rates
            print(
                f"  rates: matmul {rates.matmul_efficiency:.2f} of peak (half at {rates.matmul_half_flops:.3g} FLOPs), "
                f"attention {rates.attention_efficiency:.2f} (causal work {rates.causal_work:.2f}; masked "
                f"{rates.masked_attention_efficiency:.2f}, backward x{rates.masked_backward_slowdown:.2f}), memory "
                f"{rates.memory_efficiency:.2f}, launch {rates.launch_overhead_s * 1e6:.1f} us"
            )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from autopar.errors import AutoparError

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, or an argument error already printed in one line
        return int(exit_.code) if isinstance(exit_.code, int) else (0 if exit_.code is None else 2)
    saved_log = os.environ.get("AUTOPAR_LOG")
    if args.verbose and not saved_log:
        os.environ["AUTOPAR_LOG"] = "1"  # read by solver.search.backends
    try:
        return args.func(args)
    except BrokenPipeError:  # stdout closed early (``autopar show plan.json | head``): not an error
        with contextlib.suppress(OSError, ValueError, AttributeError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (AutoparError, CliError, ValueError, OSError, ImportError) as error:
        if args.debug:
            raise
        named = isinstance(error, AutoparError) and not isinstance(error, CliError)  # a CliError is already a sentence
        _print_error(f"{type(error).__name__}: {error}" if named else error)
        return 1
    except KeyboardInterrupt:
        _print_error("interrupted")
        return 130
    finally:
        if saved_log is None:
            os.environ.pop("AUTOPAR_LOG", None)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
