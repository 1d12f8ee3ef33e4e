"""Planners built on the problem and its strategies: sharding (``solve``), memory decisions, pipeline
stages, mesh search, hand plans."""
