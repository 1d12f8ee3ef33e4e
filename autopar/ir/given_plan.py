"""The options ``compile`` runs a given plan under: the plan's precision policy, data layout
and pipeline. An option asked for beside the plan must agree with what the plan was made for."""

from __future__ import annotations

from typing import Any

from autopar.errors import ConfigTypeError, PlanError
from autopar.ir.data import DataOptions
from autopar.ir.options import DEFAULT_OPTIMIZER, MixedPrecision, PipelineOptions, PlanOptions, precision_policy
from autopar.ir.plan import Plan


def options_for_plan(plan: Plan | None, options: PlanOptions, precision_asked: bool, data_asked: bool) -> PlanOptions:
    """``options`` with ``plan``'s precision, data layout and pipeline (without a plan, ``options``
    as they are). ``options.precision`` and ``options.data`` must agree with the plan where they
    were asked for (``precision_asked``, ``data_asked``), and a pipeline wherever it is enabled."""
    if plan is None:
        return options
    precision = precision_of(plan, options.precision if precision_asked else None)
    data = data_of(plan, options.data if data_asked else None)
    if options.optimizer not in (DEFAULT_OPTIMIZER, plan.optimizer):
        raise PlanError(
            f"optimizer={options.optimizer!r} contradicts the plan, which was priced for optimizer={plan.optimizer!r}: "
            "drop optimizer= to run the plan as it is, or re-plan with the optimizer the loop steps with"
        )
    return pipeline_of(plan, options).replace(precision=precision, data=data, optimizer=plan.optimizer)


def precision_of(plan: Plan | None, precision: str | MixedPrecision | None) -> MixedPrecision:
    """The policy to run: the plan's (which ``precision``, where given, must agree with), else
    ``precision``'s."""
    if plan is None:
        return precision_policy(precision)
    recorded = plan.precision or precision_policy(None)
    if precision is not None and dtypes_of(precision_policy(precision)) != dtypes_of(recorded):
        raise PlanError(
            f"precision={precision_policy(precision).name!r} contradicts the plan, which was made for "
            f"precision={recorded.name!r} ({recorded.to_json()}): drop precision= to run the plan as it "
            "is, or re-plan with the precision you want"
        )
    return recorded


def dtypes_of(policy: MixedPrecision) -> dict[str, Any]:
    return {key: value for key, value in policy.to_json().items() if key != "name"}


def data_of(plan: Plan | None, data: DataOptions | None) -> DataOptions:
    """The data options to run: the plan's (which ``data``, where given, must agree with), else ``data``'s."""
    if data is not None and not isinstance(data, DataOptions):
        raise ConfigTypeError(f"data must be an autopar.DataOptions, got {data!r}")
    if plan is None:
        return data or DataOptions()
    recorded = DataOptions(plan.data_layout.batch)
    if data is not None and data != recorded:
        raise PlanError(
            f"data=DataOptions(batch={data.batch!r}) contradicts the plan, which was made for batch={recorded.batch!r}: "
            f"drop data= to run the plan as it is, or re-plan with autopar.plan(..., data=DataOptions(batch={data.batch!r}))"
        )
    return recorded


def pipeline_of(plan: Plan | None, options: PlanOptions) -> PlanOptions:
    """The pipeline options of a given plan, checked against the ones asked for (``options``
    as they are without a plan)."""
    if plan is None:
        return options
    asked = options.pipeline
    given = (plan.pipeline.num_stages, plan.pipeline.num_microbatches) if plan.pipeline is not None else None
    if asked.enabled and (
        given is None
        or (asked.stages != "auto" and given != (asked.stages, asked.microbatches))
        or (asked.stages == "auto" and asked.num_microbatches not in (None, "auto", given[1]))
    ):
        has = f"has {given[0]} stages and {given[1]} microbatches" if given else "does not pipeline"
        raise PlanError(
            f"pipeline={asked.stages!r}, num_microbatches={asked.num_microbatches!r} contradicts the plan, which {has}: "
            "drop pipeline and num_microbatches to run the plan as it is, or re-plan"
        )
    return options.replace(pipeline=PipelineOptions(*given)) if given else options


__all__ = ["options_for_plan", "precision_of", "data_of", "pipeline_of"]
