"""Kernel implementations (see autopar.kernels)."""

from __future__ import annotations

from autopar.kernels import register_kernel  # noqa: F401
