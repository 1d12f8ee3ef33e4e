"""The ``autopar`` command line.

    autopar plan MODEL_SPEC (--mesh 2x4 | --devices 64) [--cluster h100-80g|FILE]
                 [--memory-budget 70GiB] [--offload auto] [--batch-size N] [--seq-len N] [--num-layers N] [--meta]
                 [--out plan.json] [--json]
    autopar show plan.json [--json] [--html report.html]
    autopar explain plan.json NODE_OR_PARAM [--json]
    autopar diff a.json b.json [--json]
    autopar check plan.json [--model MODEL_SPEC] [--rank R] [--numerics] [--json]

MODEL_SPEC is a built-in model name (``autopar.zoo.models.MODEL_NAMES``), a published shape
(``autopar.zoo.shapes.PRESETS``: gpt2, gpt2-xl, llama-2-7b, llama-2-70b, llama-3-8b, built on
the meta device), or ``module:callable`` (``path/to/file.py:callable`` works too), where the
callable returns ``(model, example_inputs)``. ``plan`` records the MODEL_SPEC in the plan, so
that ``check`` can rebuild the model.

Every user mistake prints one line ``autopar: error: <reason>`` to stderr and exits with status 2
(bad arguments) or 1 (errors while running); ``--debug`` shows the traceback instead.
"""

# Every autopar import in this file sits inside the command that needs it, for start-up speed:
# `autopar --help` and argument errors load no torch.
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Sequence

PROG = "autopar"


class CliError(Exception):
    """A user mistake found while running a command (exit status 1)."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, ``autopar: error: <reason>``, status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        _print_error(message)
        raise SystemExit(2)


def _print_error(message: str) -> None:
    text = " ".join(line.strip() for line in str(message).strip().splitlines() if line.strip())
    print(f"{PROG}: error: {text or 'unknown error'}", file=sys.stderr)


# -- argument types ---------------------------------------------------------------------------

def parse_mesh(text: str) -> tuple[int, ...]:
    """``"2x4"``, ``"2,4"`` or ``"8"`` → a tuple of positive ints."""
    parts = re.split(r"[x,]", text.strip().lower())
    if not text.strip() or any(not p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(
            f"invalid mesh {text!r}: expected positive sizes such as '2x4', '2,4' or '8'"
        )
    shape = tuple(int(p) for p in parts)
    if any(n < 1 for n in shape):
        raise argparse.ArgumentTypeError(f"invalid mesh {text!r}: every mesh size must be at least 1")
    return shape


_UNITS = {
    "": 1, "b": 1,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}


def parse_bytes(text: str) -> int:
    """``"70GiB"``, ``"512 MiB"``, ``"1.5GB"`` or ``"1000000"`` → bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"invalid memory budget {text!r}: expected bytes, or a number with a unit "
            "(KiB, MiB, GiB, TiB, KB, MB, GB), such as '70GiB'"
        )
    value = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value < 1:
        raise argparse.ArgumentTypeError(f"invalid memory budget {text!r}: must be at least 1 byte")
    return int(value)


def _cluster(text: str):
    from autopar.cost.cluster import get_cluster

    try:
        return get_cluster(text)
    except (ValueError, OSError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None


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


# -- formatting helpers -----------------------------------------------------------------------

def _fmt_outs(outs) -> str:
    from autopar.ir.spec import spec_text  # start-up speed: --help loads no torch

    if len(outs) == 1:
        return spec_text(outs[0])
    return "[" + ", ".join(spec_text(s) for s in outs) + "]"


def _fmt_predicted(key: str, value: Any) -> str:
    from autopar.ir.summary import format_bytes  # start-up speed: --help loads no torch

    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return str(value)
    if key.endswith("_bytes"):
        return format_bytes(value)
    if key.endswith("_s"):
        return f"{value * 1e3:.4f} ms"
    return f"{value:g}"


_INDEX_RE = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)")


def param_groups(plan) -> list[dict[str, Any]]:
    """Parameters grouped by FQN with layer indices replaced by ``*`` and by placements.

    A group of one keeps its own FQN; a larger group is named by its pattern, such as
    ``transformer.h.*.attn.q_proj.weight``. Groups are in order of first appearance.
    """
    from autopar.ir.spec import format_spec

    groups: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for fqn, spec in plan.params.items():
        placements = tuple(format_spec(spec))
        groups.setdefault((_INDEX_RE.sub("*", fqn), placements), []).append(fqn)
    rows = []
    for (pattern, placements), members in groups.items():
        rows.append({"fqn": pattern if len(members) > 1 else members[0], "placements": list(placements),
                     "count": len(members)})
    return rows


def collective_counts(plan) -> list[dict[str, Any]]:
    """Forward collectives of the plan's redistributions: kind, mesh axis, count."""
    return [{"kind": kind, "axis": axis, "count": n} for (kind, axis), n in plan.collective_counts().items()]


def groups_text(plan) -> str:
    rows = param_groups(plan)
    lines = [f"Parameter groups ({len(rows)} groups, {len(plan.params)} parameters)"]
    width = max((len(r["fqn"]) for r in rows), default=10)
    for row in rows:
        lines.append(f"  {row['fqn']:<{width}}  {'(' + ', '.join(row['placements']) + ')':<16} x{row['count']}")
    return "\n".join(lines)


def plan_text(plan) -> str:
    return plan.summary() + "\n\n" + groups_text(plan)


def show_json(plan) -> dict[str, Any]:
    out = {
        "mesh": list(plan.mesh_shape),
        "cluster": plan.cluster,
        "graph_hash": plan.graph_hash,
        "plan_hash": plan.hash,
        "predicted": plan.predicted,
        "solver": plan.solver,
        "params": param_groups(plan),
        "collectives": collective_counts(plan),
    }
    if plan.pipeline is not None:
        # The stages without their node lists, which the plan file has.
        data = plan.pipeline.to_json()
        data["stages"] = [{k: v for k, v in s.items() if k != "nodes"} | {"num_nodes": len(s["nodes"])}
                          for s in data["stages"]]
        out["pipeline"] = data
    return out


# -- model loading ----------------------------------------------------------------------------

def _progress(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def _shape_overrides(spec: str, seq_len: int | None, num_layers: int | None) -> tuple[dict, dict]:
    """(model config, batch config) for --seq-len and --num-layers of a built-in gpt or llama."""
    if (seq_len or num_layers) and spec not in ("gpt", "llama"):
        raise CliError(f"--seq-len and --num-layers apply to gpt, llama and the presets, not to {spec!r}")
    return ({"n_layer": num_layers} if num_layers else {}), ({"seq_len": seq_len} if seq_len else {})


def load_model(spec: str, batch_size: int, meta: bool, seq_len: int | None = None,
               num_layers: int | None = None) -> tuple[Any, tuple]:
    """``(model, example_inputs)`` for a built-in name, a preset, or a ``module:callable`` MODEL_SPEC."""
    import torch

    from autopar.zoo import shapes as model_specs


    from autopar.zoo import models

    if spec in model_specs.PRESETS:
        return model_specs.build_preset(spec, batch_size, seq_len, num_layers)
    if spec in models.MODEL_NAMES:
        config, batch_config = _shape_overrides(spec, seq_len, num_layers)
        if meta:
            with torch.device("meta"):
                model = models.build_model(spec, **config)
                inputs = models.example_batch(spec, batch_size, **config, **batch_config)
            inputs = tuple(
                t if not isinstance(t, torch.Tensor) or t.is_meta else torch.empty_like(t, device="meta")
                for t in inputs
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
            f"MODEL_SPEC {spec!r} must return (model, example_inputs) with an nn.Module and a tuple, "
            f"got {type(result).__name__}"
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
    """Prints the planner's stage messages (INFO on the ``autopar`` logger) as progress lines."""

    def __init__(self) -> None:
        import logging

        self.logger = logging.getLogger("autopar")
        self.handler = logging.StreamHandler(sys.stderr)
        self.handler.setFormatter(logging.Formatter("%(message)s"))
        self.handler.addFilter(lambda record: record.levelno == logging.INFO)
        self.level = self.logger.level

    def __enter__(self) -> "_ProgressLog":
        import logging

        self.logger.addHandler(self.handler)
        self.logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)


def cmd_plan(args: argparse.Namespace) -> int:
    from autopar import api
    from autopar.cost.cluster import get_cluster
    from autopar.ir.options import PlanOptions
    from autopar.solver.mesh_search import mesh_search_text

    cluster = args.cluster if args.cluster is not None else get_cluster(None)
    if (args.pipeline is not None or args.num_microbatches is not None) and (args.pipeline is None or not args.mesh):
        raise CliError("--num-microbatches and --pipeline need --pipeline N and --mesh: a pipeline cuts axis 0 "
                       "of a given mesh into N stages")
    options = PlanOptions.from_keywords(
        memory_budget=args.memory_budget, time_limit_s=args.time_limit, pipeline=args.pipeline or "off",
        num_microbatches=args.num_microbatches, offload=args.offload, devices=None if args.mesh else args.devices,
    )
    start = time.perf_counter()
    _progress(f"building {args.model}{' on the meta device' if args.meta else ''} ...")
    model, inputs = load_model(args.model, args.batch_size, args.meta, args.seq_len, args.num_layers)
    _progress(f"built {type(model).__name__} in {time.perf_counter() - start:.2f} s")
    stage = time.perf_counter()
    if not args.mesh:
        _progress(f"planning on every mesh of {args.devices} devices for cluster {getattr(cluster, 'name', '?')} ...")
    with _ProgressLog():
        plan = api.plan_model(model, args.mesh or "auto", inputs, None, cluster, options, on_progress=_progress)
    plan = plan.with_model(_model_record(args))
    _progress(f"planned {len(plan.nodes)} nodes in {time.perf_counter() - stage:.2f} s "
              f"(total {time.perf_counter() - start:.2f} s)")
    if args.out:
        plan.save(args.out)
        _progress(f"saved the plan to {args.out}")
    if args.json:
        print(plan.to_json())
        return 0
    if "mesh_search" in plan.stats:
        print(mesh_search_text(plan.stats["mesh_search"]) + "\n")
    print(plan_text(plan))
    return 0


def _device_memory(cluster_name: str) -> int | None:
    """The device memory of the cluster a plan was priced for, where it is a preset or a readable file."""
    from autopar.cost.cluster import get_cluster

    try:
        return get_cluster(cluster_name).memory_bytes if cluster_name else None
    except (ValueError, OSError):
        return None


def cmd_show(args: argparse.Namespace) -> int:
    from autopar.ir.plan import Plan

    plan = Plan.load(args.plan)
    if args.html:
        from autopar.report.html import write_html

        write_html(plan, args.html, title=f"autopar plan {Path(args.plan).name}",
                   device_memory_bytes=_device_memory(plan.cluster))
        _progress(f"wrote {args.html}")
    if args.json:
        print(json.dumps(show_json(plan), separators=(",", ":")))
    elif not args.html:
        print(plan_text(plan))
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from autopar.report.explain import explain_json, explain_text
    from autopar.ir.plan import Plan

    plan = Plan.load(args.plan)
    if not plan.decisions and plan.pipeline is not None:
        raise CliError(f"{args.plan} is a pipelined plan, whose stages take their choices from several "
                       "candidate plans, and it records no explanations yet: plan the same model on the "
                       "stage mesh without --pipeline to explain the intra-stage choices")
    if not plan.decisions:
        raise CliError(f"{args.plan} holds no decisions to explain (it was written by an autopar "
                       "without them, or by hand): re-plan it with this autopar")
    if args.json:
        print(json.dumps(explain_json(plan, args.node), separators=(",", ":")))
    else:
        print(explain_text(plan, args.node))
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from autopar.runtime.check import check_plan
    from autopar.ir.plan import Plan

    plan = Plan.load(args.plan)
    record = dict(plan.model)
    if args.model:
        record = {"spec": args.model, "batch_size": args.batch_size or 8, "meta": args.meta,
                  "seq_len": args.seq_len, "num_layers": args.num_layers}
    if not record.get("spec"):
        raise CliError(f"{args.plan} does not say which model it plans (it was not made by `autopar plan`): "
                       "pass --model MODEL_SPEC")
    start = time.perf_counter()
    _progress(f"building {record['spec']} ...")
    model, inputs = load_model(record["spec"], record.get("batch_size") or 8, bool(record.get("meta")),
                               record.get("seq_len"), record.get("num_layers"))
    world = math.prod(plan.mesh_shape)
    if args.numerics:
        return _check_numerics(args, plan, model, inputs, world, start)
    _progress(f"checking rank {args.rank} of {world} on a fake process group ...")
    result = check_plan(plan, model, inputs, rank=args.rank)
    _progress(f"checked in {time.perf_counter() - start:.2f} s")
    if args.json:
        print(json.dumps({"ok": result.ok, "rank": result.rank, "world_size": result.world_size,
                          "coordinate": list(result.coordinate), "num_nodes": result.num_nodes,
                          "num_inputs": result.num_inputs, "num_collectives": result.num_collectives,
                          "mismatches": list(result.mismatches)}, separators=(",", ":")))
    else:
        print(result.text())
    return 0 if result.ok else 1


def _check_numerics(args: argparse.Namespace, plan, model, inputs, world: int, start: float) -> int:
    from autopar.runtime.numerics import check_numerics
    from autopar.trace.fake import has_meta_tensors

    if has_meta_tensors(model):
        raise CliError(f"--numerics runs the model on real tensors, but {plan.model.get('spec')} is built on the "
                       "meta device (a published shape): check a small built-in model, or pass --model without --meta")
    _progress(f"running all {world} ranks in this process and eager, on the plan's inputs ...")
    result = check_numerics(model, plan, inputs if isinstance(inputs, tuple) else (inputs,))
    _progress(f"checked in {time.perf_counter() - start:.2f} s")
    if args.json:
        first = result.first_bad
        print(json.dumps({"ok": result.ok, "mesh": list(result.mesh_shape), "num_nodes": result.num_nodes,
                          "loss": list(result.loss) if result.loss else None, "max_grad_rel": result.max_grad_rel,
                          "first_bad": None if first is None else {"node": first.node, "op": first.op,
                                                                   "rel_diff": first.rel_diff}},
                         separators=(",", ":")))
    else:
        print(result.text())
    return 0 if result.ok else 1


_MAIN_PREDICTED = ("step_time_s", "peak_memory_bytes", "comm_bytes")


def plan_diff(a, b) -> dict[str, Any]:
    """What differs between plans ``a`` and ``b``; empty sections are left out."""
    from autopar.ir.spec import format_spec

    diff: dict[str, Any] = {}
    if tuple(a.mesh_shape) != tuple(b.mesh_shape):
        diff["mesh"] = {"a": list(a.mesh_shape), "b": list(b.mesh_shape)}
    for key, va, vb in (("graph_hash", a.graph_hash, b.graph_hash), ("cluster", a.cluster, b.cluster),
                        ("torch_version", a.torch_version, b.torch_version)):
        if va != vb:
            diff[key] = {"a": va, "b": vb}
    keys = [k for k in _MAIN_PREDICTED if k in a.predicted or k in b.predicted]
    keys += sorted((set(a.predicted) | set(b.predicted)) - set(keys))
    predicted = {}
    for key in keys:
        va, vb = a.predicted.get(key), b.predicted.get(key)
        if va == vb:
            continue
        entry: dict[str, Any] = {"a": va, "b": vb}
        if isinstance(va, (int, float)) and isinstance(vb, (int, float)):
            entry["rel_change"] = (vb - va) / va if va else None
        predicted[key] = entry
    if predicted:
        diff["predicted"] = predicted
    solver = {k: {"a": a.solver.get(k), "b": b.solver.get(k)}
              for k in ("status", "memory_budget_bytes", "fallbacks")
              if a.solver.get(k) != b.solver.get(k)}
    if solver:
        diff["solver"] = solver
    params = []
    for fqn in list(a.params) + [f for f in b.params if f not in a.params]:
        sa, sb = a.params.get(fqn), b.params.get(fqn)
        if sa != sb:
            params.append({"fqn": fqn, "a": format_spec(sa) if sa is not None else None,
                           "b": format_spec(sb) if sb is not None else None})
    if params:
        diff["params"] = params
    nodes = []
    for name, na in a.nodes.items():
        nb = b.nodes.get(name)
        if nb is not None and (na.outs != nb.outs or na.op != nb.op):
            nodes.append({"name": name, "op": na.op if na.op == nb.op else f"{na.op} -> {nb.op}",
                          "a": [format_spec(s) for s in na.outs], "b": [format_spec(s) for s in nb.outs]})
    if nodes:
        diff["nodes"] = nodes
    only_a = [n for n in a.nodes if n not in b.nodes]
    only_b = [n for n in b.nodes if n not in a.nodes]
    if only_a:
        diff["only_in_a"] = only_a
    if only_b:
        diff["only_in_b"] = only_b
    return diff


def diff_text(diff: dict[str, Any], path_a: str, path_b: str, a, b) -> str:
    lines = [f"a: {path_a}  mesh={tuple(a.mesh_shape)}  cluster={a.cluster or '-'}  plan={a.hash}",
             f"b: {path_b}  mesh={tuple(b.mesh_shape)}  cluster={b.cluster or '-'}  plan={b.hash}"]
    if not diff:
        lines.append("plans are identical")
        return "\n".join(lines)
    if "mesh" in diff:
        lines.append(f"mesh: {tuple(diff['mesh']['a'])} -> {tuple(diff['mesh']['b'])}")
    for key, label in (("graph_hash", "graph hash"), ("cluster", "cluster"), ("torch_version", "torch")):
        if key in diff:
            lines.append(f"{label}: {diff[key]['a']} -> {diff[key]['b']}")
    if "predicted" in diff:
        lines.append("predicted:")
        width = max(len(k) for k in diff["predicted"])
        for key, entry in diff["predicted"].items():
            rel = entry.get("rel_change")
            change = f"  ({rel * 100:+.1f}%)" if rel is not None else ""
            lines.append(f"  {key:<{width}}  {_fmt_predicted(key, entry['a'])} -> "
                         f"{_fmt_predicted(key, entry['b'])}{change}")
    if "solver" in diff:
        for key, entry in diff["solver"].items():
            lines.append(f"solver {key}: {entry['a']} -> {entry['b']}")

    def listed(spec):
        return "-" if spec is None else "(" + ", ".join(spec) + ")"

    if "params" in diff:
        rows = diff["params"]
        lines.append(f"Parameters with different placements ({len(rows)}):")
        width = max(len(r["fqn"]) for r in rows)
        for row in rows:
            lines.append(f"  {row['fqn']:<{width}}  {listed(row['a'])} -> {listed(row['b'])}")
    if "nodes" in diff:
        rows = diff["nodes"]
        lines.append(f"Nodes with different output placements ({len(rows)}):")
        width = max(len(r["name"]) for r in rows)
        op_width = max(len(r["op"]) for r in rows)

        def outs_text(outs):
            return listed(outs[0]) if len(outs) == 1 else "[" + ", ".join(listed(s) for s in outs) + "]"

        for row in rows:
            lines.append(f"  {row['name']:<{width}}  {row['op']:<{op_width}}  {outs_text(row['a'])} -> {outs_text(row['b'])}")
    for key, label in (("only_in_a", "a"), ("only_in_b", "b")):
        if key in diff:
            lines.append(f"Nodes only in {label} ({len(diff[key])}): {', '.join(diff[key])}")
    return "\n".join(lines)


def cmd_diff(args: argparse.Namespace) -> int:
    from autopar.ir.plan import Plan

    a, b = Plan.load(args.a), Plan.load(args.b)
    diff = plan_diff(a, b)
    if args.json:
        print(json.dumps({"identical": not diff, **diff}, separators=(",", ":")))
    else:
        print(diff_text(diff, args.a, args.b, a, b))
    return 0


# -- entry point ------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    from autopar.cost.cluster import DEFAULT_PRESET, preset_names
    from autopar.zoo.shapes import PRESETS
    from autopar.zoo.models import MODEL_NAMES

    parser = _Parser(prog=PROG, description="autopar: an auto-parallel compiler for PyTorch training.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    p = sub.add_parser("plan", help="plan a model on a mesh and print the plan summary")
    p.add_argument("model", metavar="MODEL_SPEC",
                   help=f"a built-in model ({', '.join(MODEL_NAMES)}), a preset ({', '.join(PRESETS)}) "
                        "or module:callable returning (model, example_inputs)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--mesh", type=parse_mesh, help="mesh sizes: 2x4, 2,4 or 8")
    where.add_argument("--devices", type=_positive_int,
                       help="search every mesh of this many devices (1 to 3 axes) and keep the fastest")
    p.add_argument("--cluster", type=_cluster, default=None,
                   help=f"a preset ({', '.join(preset_names())}; default {DEFAULT_PRESET}) or a JSON/TOML file")
    p.add_argument("--memory-budget", type=parse_bytes, default=None,
                   help="bytes per device, e.g. 70GiB, 512MiB, 16GB")
    p.add_argument("--batch-size", type=_positive_int, default=8, help="batch size of built-in models (default 8)")
    p.add_argument("--seq-len", type=_positive_int, default=None, help="sequence length of gpt, llama and presets")
    p.add_argument("--num-layers", type=_positive_int, default=None,
                   help="depth of gpt, llama and presets (a 2-layer llama-2-70b has the real widths)")
    p.add_argument("--meta", action="store_true", help="build built-in models and inputs on the meta device")
    p.add_argument("--time-limit", type=_positive_float, default=60.0, help="solver time limit in seconds")
    p.add_argument("--pipeline", type=_stages, default=None, metavar="N|auto",
                   help="cut mesh axis 0 into N pipeline stages, or let the planner choose (auto); needs --mesh")
    p.add_argument("--num-microbatches", type=_positive_int, default=None, metavar="M",
                   help="with --pipeline: microbatches per step (default N, or 1 with auto)")
    p.add_argument("--offload", default="off", metavar="auto|off|cpu|disk",
                   help="when no sharding fits --memory-budget, let the planner add checkpointing and offload "
                        "(autopar.plan's offload=; with --mesh only)")
    p.add_argument("--out", help="save the plan JSON here")
    p.add_argument("--json", action="store_true", help="print the plan JSON instead of the summary")
    p.set_defaults(func=cmd_plan)

    s = sub.add_parser("show", help="print a saved plan's summary")
    s.add_argument("plan", help="plan JSON file")
    s.add_argument("--json", action="store_true", help="print a compact JSON summary")
    s.add_argument("--html", metavar="PATH", help="write a self-contained HTML report here")
    s.set_defaults(func=cmd_show)

    e = sub.add_parser("explain", help="why the plan chose a node's or a parameter's sharding")
    e.add_argument("plan", help="plan JSON file")
    e.add_argument("node", metavar="NODE_OR_PARAM", help="a node name or a parameter FQN")
    e.add_argument("--json", action="store_true", help="print the decision as JSON")
    e.set_defaults(func=cmd_explain)

    c = sub.add_parser("check", help="run the plan's rewritten forward at full world size on a fake process group")
    c.add_argument("plan", help="plan JSON file")
    c.add_argument("--model", metavar="MODEL_SPEC", help="the model (default: the MODEL_SPEC recorded in the plan)")
    c.add_argument("--batch-size", type=_positive_int, default=None, help="with --model: batch size (default 8)")
    c.add_argument("--seq-len", type=_positive_int, default=None, help="with --model: sequence length")
    c.add_argument("--num-layers", type=_positive_int, default=None, help="with --model: depth")
    c.add_argument("--meta", action="store_true", help="with --model: build a built-in model on the meta device")
    c.add_argument("--rank", type=_nonnegative_int, default=0, help="the rank whose module runs (default 0)")
    c.add_argument("--numerics", action="store_true",
                   help="run every rank's rewritten module in this process on the model's real tensors and "
                        "compare each node, the loss and every gradient with eager (names the first node that differs)")
    c.add_argument("--json", action="store_true", help="print the result as JSON")
    c.set_defaults(func=cmd_check)

    d = sub.add_parser("diff", help="what changed between two plans")
    d.add_argument("a", help="first plan JSON file")
    d.add_argument("b", help="second plan JSON file")
    d.add_argument("--json", action="store_true", help="print the differences as JSON")
    d.set_defaults(func=cmd_diff)

    f = sub.add_parser("profile", help="measure this machine (roofline, links per mesh axis) into a ClusterSpec file")
    f.add_argument("--out", required=True, help="write the ClusterSpec JSON (or .toml) here")
    f.add_argument("--mesh", type=parse_mesh, default=None, help="mesh whose axes' links to time, e.g. 2x2")
    f.add_argument("--spawn", action="store_true", help="start prod(mesh) local gloo ranks to time collectives")
    f.add_argument("--full", action="store_true", help="larger matmuls, copies and all-reduces (slower, steadier)")
    f.set_defaults(func=cmd_profile)
    return parser


def cmd_profile(args: argparse.Namespace) -> int:
    from autopar.runtime.profile import run_profile

    spec = run_profile(args.out, args.mesh, args.spawn, quick=not args.full)
    if spec is not None:
        print(f"wrote {args.out}: {spec.name}, float32 {spec.peak_flops['float32']:.3g} FLOP/s, "
              f"memory {spec.memory_bandwidth_bytes_per_s:.3g} B/s, intra-node alpha {spec.intra_node.latency_s:.3g} s "
              f"beta {spec.intra_node.bandwidth_bytes_per_s:.3g} B/s")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from autopar.errors import AutoparError

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, or an argument error already printed in one line
        return int(exit_.code) if isinstance(exit_.code, int) else (0 if exit_.code is None else 2)
    try:
        return args.func(args)
    except BrokenPipeError:  # stdout closed early (``autopar show plan.json | head``): not an error
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        return 0
    except (AutoparError, CliError, ValueError, OSError, ImportError) as error:
        if args.debug:
            raise
        _print_error(f"{type(error).__name__}: {error}" if isinstance(error, AutoparError) else error)
        return 1
    except KeyboardInterrupt:
        _print_error("interrupted")
        return 130


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
