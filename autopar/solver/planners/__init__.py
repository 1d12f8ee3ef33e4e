"""Planners built on the problem and its search: the planning dispatch from a model (``dispatch``)
and the one entry on a traced model (``traced.plan_traced``), sharding (``solve``), memory
decisions, pipeline stages, mesh search, hand plans; ``settings`` resolves the memory budget they
all plan under."""
