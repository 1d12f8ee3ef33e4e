"""Optimizers that step offloaded state (``autopar.runtime.optim``): ``autopar.optim.AdamW(pm, lr=...)``."""

from autopar.runtime.optim import AdamW

__all__ = ["AdamW"]
