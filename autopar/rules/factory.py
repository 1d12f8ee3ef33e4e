"""Sharding rules: factory (to be filled in)."""

from autopar.rules.registry import Row, register  # noqa: F401
